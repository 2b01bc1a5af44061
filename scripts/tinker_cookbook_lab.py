"""tinker-cookbook's three recipes on one `rlexp tinker` server, alone and all at once: sl_loop (SFT),
rl_loop (RL from the SFT'd weights) and the on-policy distillation recipe (a student taught by the
SFT'd weights as its teacher), each unchanged, on the tiny model (served under a cookbook model name).

    .venv/bin/python scripts/tinker_cookbook_lab.py OUT [--sl-steps 150] [--rl-steps 50]
                                                    [--distill-steps 20] [--max-operand 1] [--plot PNG]

1. OUT/hf: the offline hub cache (scripts/tinker_hub_cache.py --format rl_loop: no_robots, gsm8k and
   DeepMath rows of sums of operands 0..max, in rl_loop's prompt; the tiny tokenizer under the alias).
2. One server on the tiny model (conf/tinker.yaml), for everything below.
3. alone: sl_loop (a full fine-tune: lora_rank=0, lr 1e-3, the loss on the final `\\boxed{N}`
   reply), whose final state and sampler weights are the SFT; then rl_loop resumed from that state
   (its own resume: a checkpoints.jsonl row in its log_path naming the state, batch 0); then the
   distillation recipe: the student the base model (LoRA), the teacher the SFT's sampler weights
   (`teacher_model` the same base name, `teacher_checkpoint` its tinker:// path), `dataset=deepmath`.
   Rank 0 is rlexp's full fine-tune (a LoRA rank the SDK sends as given): the 2-layer model learns
   rl_loop's format from a LoRA SFT too slowly to start RL (docs/tinker.md), and rl_loop trains the
   weights its state holds, so it is a full fine-tune too.
4. together: the same three started at once against the same server.
5. Each run's own metrics.jsonl: sl_loop's train_mean_nll, rl_loop's reward/total, distillation's
   teacher_kl; alone against together. Prints them, then `ratio:` rl_loop's mean reward over its
   last half together to alone.

Needs .venv and .venv-tinker (make envs)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from tinker_two_callers import start_server  # this folder's: scripts run as files put it on sys.path

ROOT = Path(__file__).resolve().parents[1]
TINKER_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
# an alias: the cookbook picks this name's renderer (ChatML), which renders the tiny tokenizer's template
MODEL_NAME = "Qwen/Qwen3-4B-Instruct-2507"
HEADLINE = {"sl": "train_mean_nll", "rl": "reward/total", "distill": "teacher_kl"}


def hub_cache(out: Path, args) -> dict[str, str]:
    """The hub cache (step 1) and the environment every recipe runs in."""
    tokenizer = out / "tokenizer"
    subprocess.run([sys.executable, "-c", "from rlexp.models.tiny import build_char_tokenizer; "
                    f"build_char_tokenizer().save_pretrained({str(tokenizer)!r})"], check=True)
    rows = args.sl_batch * args.sl_steps
    subprocess.run([sys.executable, str(ROOT / "scripts" / "tinker_hub_cache.py"), str(out / "hf"),
                    "--tokenizer", str(tokenizer), "--model-id", MODEL_NAME, "--format", "rl_loop",
                    "--ops", "+", "--max-operand", str(args.max_operand), "--with-replacement",
                    "--train-rows", str(rows), "--test-rows", "64"], check=True)
    return os.environ | {"HF_HOME": str(out / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                         "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0"}


def recipe_commands(url: str, log: Path, sft: dict[str, str] | None, args) -> dict[str, list[str]]:
    """Each recipe's command line (their chz options), logging under `log`/<recipe>."""
    common = [f"base_url={url}", f"model_name={MODEL_NAME}"]
    module = "tinker_cookbook.recipes."
    commands = {"sl": [module + "sl_loop", *common, f"log_path={log / 'sl'}", f"batch_size={args.sl_batch}",
                       f"learning_rate={args.sl_lr}", "lora_rank=0", "save_every=0",
                       "train_on_what=last_assistant_message"]}
    if sft is not None:
        commands["rl"] = [module + "rl_loop", *common, f"log_path={log / 'rl'}",
                          f"batch_size={args.rl_batch}", f"group_size={args.group}",
                          f"max_tokens={args.max_tokens}",
                          f"learning_rate={args.rl_lr}", f"max_steps={args.rl_steps}", "save_every=0",
                          "loss_fn=importance_sampling"]
        commands["distill"] = [module + "distillation.on_policy_distillation", *common,
                               f"log_path={log / 'distill'}", f"teacher_model={MODEL_NAME}",
                               f"teacher_checkpoint={sft['sampler_path']}", "dataset=deepmath",
                               f"group_size={args.group // 2}", f"groups_per_batch={args.rl_batch}",
                               f"learning_rate={args.distill_lr}", f"lora_rank={args.distill_rank}",
                               f"max_tokens={args.max_tokens}", f"max_steps={args.distill_steps}",
                               "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"]
        # rl_loop starts where its log_path's last checkpoint is: the SFT's state, at batch 0
        (log / "rl").mkdir(parents=True, exist_ok=True)
        (log / "rl" / "checkpoints.jsonl").write_text(json.dumps(
            {"name": "sft", "batch": 0, "state_path": sft["state_path"]}) + "\n")
    return {name: [str(TINKER_PYTHON), "-m", *cmd] for name, cmd in commands.items()}


def run_all(commands: dict[str, list[str]], log: Path, env: dict[str, str]) -> None:
    """Start every command at once; wait for all; fail naming the one that failed."""
    log.mkdir(parents=True, exist_ok=True)
    procs = {name: subprocess.Popen(cmd, stdout=open(log / f"{name}.log", "w"), stderr=subprocess.STDOUT,
                                    env=env)
             for name, cmd in commands.items()}
    try:
        failed = [name for name, proc in procs.items() if proc.wait()]
    finally:
        for proc in procs.values():
            proc.kill()
    if failed:
        tails = "\n".join(f"--- {n}: the end of {log / (n + '.log')}\n"
                          + "\n".join((log / f"{n}.log").read_text().splitlines()[-15:]) for n in failed)
        raise RuntimeError(f"{', '.join(failed)} failed\n{tails}")


def metric(log: Path, name: str) -> list[float]:
    key = HEADLINE[name]
    rows = [json.loads(line) for line in (log / name / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def final_sft(log: Path) -> dict[str, str]:
    rows = [json.loads(line) for line in (log / "sl" / "checkpoints.jsonl").read_text().splitlines()]
    return [r for r in rows if r["name"] == "final"][-1]


def plot(curves: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    titles = {"sl": "sl_loop (SFT, full weights)", "rl": "rl_loop (from the SFT, full weights)",
              "distill": "on-policy distillation (LoRA student, SFT teacher)"}
    for ax, (name, key) in zip(axes, HEADLINE.items()):
        for when, style in (("alone", "-"), ("together", "--")):
            ax.plot(range(len(curves[when][name])), curves[when][name], style, label=when)
        ax.set_title(titles[name], fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-operand", type=int, default=1)
    parser.add_argument("--sl-steps", type=int, default=150)
    parser.add_argument("--sl-batch", type=int, default=16)
    parser.add_argument("--sl-lr", type=float, default=1e-3)
    parser.add_argument("--rl-steps", type=int, default=50)
    parser.add_argument("--rl-batch", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rl-lr", type=float, default=2e-4)
    parser.add_argument("--distill-steps", type=int, default=20)
    parser.add_argument("--distill-lr", type=float, default=1e-3)
    parser.add_argument("--distill-rank", type=int, default=32)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    out = args.out.resolve()
    if out.exists():
        sys.exit(f"tinker_cookbook_lab: {out} exists (the recipes would resume from it): use a fresh OUT")
    out.mkdir(parents=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stopped study stops its server too
    env = hub_cache(out, args)
    # rl_loop's prompt is 371 tokens of the tiny tokenizer
    server, url = start_server(out, f"tinker.base_model={MODEL_NAME}", "tinker.max_models=16",
                               "rollout.max_model_len=512")
    try:
        alone, together = out / "alone", out / "together"
        run_all(recipe_commands(url, alone, None, args), alone, env)
        sft = final_sft(alone)
        for name, cmd in recipe_commands(url, alone, sft, args).items():
            if name != "sl":
                run_all({name: cmd}, alone, env)
        run_all(recipe_commands(url, together, sft, args), together, env)
    finally:
        server.terminate()
        server.wait(timeout=120)
    curves = {when: {name: metric(log, name) for name in HEADLINE} for when, log in
              (("alone", alone), ("together", together))}
    if args.plot:
        plot(curves, args.plot)
    half = {}
    for name, key in HEADLINE.items():
        a, t = curves["alone"][name], curves["together"][name]
        print(f"{name} {key} alone:    " + " ".join(f"{x:.3f}" for x in a))
        print(f"{name} {key} together: " + " ".join(f"{x:.3f}" for x in t))
        h = len(a) // 2
        half[name] = (statistics.mean(a[h:]), statistics.mean(t[h:]))
        print(f"{name}: first {a[0]:.3f} alone, {t[0]:.3f} together; mean of the last half "
              f"{half[name][0]:.3f} alone, {half[name][1]:.3f} together; same numbers: {a == t}")
    print(f"ratio: {half['rl'][1] / half['rl'][0]:.3f}")


if __name__ == "__main__":
    main()
