"""tinker-cookbook's recipes, unchanged, against `rlexp tinker` (scripts/tinker_cookbook_lab.py
at test size): sl_loop teaches the tiny model rl_loop's format; the on-policy distillation recipe
scores with the teacher it names (the base model, or that SFT's checkpoint); rl_loop, resumed
from the SFT's state, earns its reward. Data from the offline hub cache
(scripts/tinker_hub_cache.py), the model served under a name the cookbook knows."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tinker_helpers import ROOT, TINKER_PYTHON, Server, require_sdk

MODEL_NAME = "Qwen/Qwen3-4B-Instruct-2507"  # the alias scripts/tinker_cookbook_lab.py serves
SL_STEPS, BATCH = 150, 16


@pytest.fixture(scope="module")
def lab(tmp_path_factory, tiny_model_path):
    require_sdk()
    root = tmp_path_factory.mktemp("cookbook")
    tokenizer = root / "tokenizer"
    tokenizer.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tiny_model_path) / f).is_file():
            shutil.copy(Path(tiny_model_path) / f, tokenizer / f)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_hub_cache.py"), str(root / "hf"),
                    "--tokenizer", str(tokenizer), "--model-id", MODEL_NAME, "--format", "rl_loop",
                    "--ops", "+", "--max-operand", "1", "--with-replacement",
                    "--train-rows", str(SL_STEPS * BATCH), "--test-rows", "16"],
                   check=True, capture_output=True)
    server = Server(root, f"tinker.base_model={MODEL_NAME}", "rollout.max_model_len=512").start()
    env = os.environ | {"HF_HOME": str(root / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                        "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0"}
    yield server, env
    server.stop()


def recipe(lab, module: str, log: Path, *options: str) -> list[dict]:
    """Run a cookbook recipe to its end; the rows of its metrics.jsonl."""
    server, env = lab
    cmd = [str(TINKER_PYTHON), "-m", f"tinker_cookbook.recipes.{module}", f"base_url={server.url}",
           f"model_name={MODEL_NAME}", f"log_path={log}", *options]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, (f"{module} exited {out.returncode}:\n{out.stdout[-2000:]}\n"
                                 f"{out.stderr[-4000:]}")
    return [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]


def test_sl_then_distillation_with_its_named_teacher_then_rl_from_the_sft(lab, tmp_path):
    sl = recipe(lab, "sl_loop", tmp_path / "sl", f"batch_size={BATCH}", "learning_rate=1e-3", "lora_rank=0",
                "save_every=0", "train_on_what=last_assistant_message")
    nll = [r["train_mean_nll"] for r in sl if "train_mean_nll" in r]
    assert len(nll) == SL_STEPS and nll[-1] < nll[0] / 4, nll
    final = [json.loads(line) for line in (tmp_path / "sl" / "checkpoints.jsonl").read_text().splitlines()]
    final = [r for r in final if r["name"] == "final"][-1]

    def distill(log: str, *teacher: str) -> float:
        rows = recipe(lab, "distillation.on_policy_distillation", tmp_path / log,
                      f"teacher_model={MODEL_NAME}", *teacher, "dataset=deepmath", "group_size=2",
                      "groups_per_batch=4", "learning_rate=1e-4", "lora_rank=8", "max_tokens=12",
                      "max_steps=1", "eval_every=0", "save_every=0",
                      "behavior_if_log_dir_exists=delete")
        return [r["teacher_kl"] for r in rows if "teacher_kl" in r][0]

    # The student (the base model, its LoRA at zero) against the base: the same weights, so the
    # sampled tokens' logprobs and the teacher's agree to the engine's numerics; against the SFT,
    # a teacher that answers otherwise, far apart. A teacher_checkpoint ignored would give ~0.
    assert abs(distill("distill_base")) < 0.02
    assert distill("distill_sft", f"teacher_checkpoint={final['sampler_path']}") > 0.5

    # rl_loop resumes from its log_path's last checkpoint: the SFT's state, at batch 0
    (tmp_path / "rl").mkdir()
    (tmp_path / "rl" / "checkpoints.jsonl").write_text(
        json.dumps({"name": "sft", "batch": 0, "state_path": final["state_path"]}) + "\n")
    rl = recipe(lab, "rl_loop", tmp_path / "rl", f"batch_size={BATCH}", "group_size=4", "max_tokens=12",
                "learning_rate=1e-4", "max_steps=2", "save_every=0", "loss_fn=importance_sampling")
    rewards = [r["reward/total"] for r in rl if "reward/total" in r]
    # The SFT'd model answers in \boxed{} (sums 0..2): a model that never learned it earns 0
    assert len(rewards) == 2 and max(rewards) > 0.1, rewards
