"""`python -m rlexp.check` (rlexp/check.py, rlexp/certificate.py): one real certificate of the
tiny model through the command line, the verdict on hand-made figures, and a bad override
refused before any engine starts."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlexp.certificate import STAGES, Certificate, StageFigures, exit_code, stand_in_rewards
from rlexp.sample import Sample
from rlexp.trainer.sync_check import AUTO_BOUNDS

ROOT = Path(__file__).resolve().parents[1]


def _check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlexp.check", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))


@pytest.mark.vllm
def test_certificate_of_the_tiny_model(tmp_path, run_models):
    """Every stage (initial load, sync 1, sync 2) x rollout kind (the configured single-turn
    agent, and multiturn) has tokens, all within the float32 bound; each update moved the weights."""
    out = tmp_path / "cert"
    # the tiny model as test_run's runs build it (same arguments: cached once per session)
    res = _check("--out", str(out), "--prompts", "2", "--samples", "2", f"model.cache_dir={run_models}",
                 "model.warm_start_steps=40", timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    cert = json.loads((out / "certificate.json").read_text())
    assert [(s["stage"], s["rollout"]) for s in cert["stages"]] == \
        [(stage, kind) for stage in STAGES for kind in ("single_turn", "multiturn")]
    for s in cert["stages"]:
        assert s["tokens"] > 0 and s["passed"], s
        assert s["bound"] == AUTO_BOUNDS["float32"] and s["max"] >= s["p99"] >= 0 and s["mean"] >= 0
        assert s["p99"] < s["bound"] and s["share_above"] == 0.0
    assert any(s["turns"] > s["samples"] for s in cert["stages"] if s["rollout"] == "multiturn")
    assert [u["before"] for u in cert["updates"]] == ["sync 1", "sync 2"]
    assert all(u["max_abs_weight_change"] > 0 for u in cert["updates"])
    assert cert["setup"]["transport"] == "RamFileTransport" and cert["exit_code"] == 0
    table = (out / "certificate.md").read_text()
    assert "| initial load | single_turn |" in table and "Verdict: every stage within the bound" in table
    assert "| sync 2 | multiturn |" in res.stdout  # the table, printed


def _figures(p99s: list[float], bound: float = 1e-3) -> list[StageFigures]:
    out = []
    for i, p99 in enumerate(p99s):
        s = StageFigures(STAGES[i % 3], i % 3, "single_turn", bound)
        s.add_diffs(torch.full((100,), p99, dtype=torch.float64))
        out.append(s)
    return out


def test_the_verdict_is_the_p99_against_the_bound():
    assert exit_code(_figures([1e-6, 5e-4, 1e-3])) == 0  # at the bound is within it
    past = _figures([1e-6, 2e-3, 1e-6])
    assert exit_code(past) == 1 and [s.passed for s in past] == [True, False, True]
    assert past[1].share_above == 1.0 and past[0].share_above == 0.0
    empty = StageFigures("sync 1", 1, "multiturn", 1e-3)  # no token to compare: not certified
    assert math.isnan(empty.p99) and exit_code([*_figures([1e-6]), empty]) == 1
    assert exit_code([]) == 1

    few = StageFigures("sync 1", 1, "single_turn", 0.25)  # bf16: a few near-tied tokens far off
    few.add_diffs(torch.cat([torch.full((995,), 0.01), torch.full((5,), 2.0)]))
    assert few.passed and few.max == 2.0 and few.share_above == pytest.approx(0.005)

    cert = Certificate("python -m rlexp.check", "2026-11-26", "here", {"model": "m"}, 1e-3, "auto",
                       [*past, empty])
    assert cert.exit_code == 1 and cert.to_json()["passed"] is False
    assert cert.to_json()["stages"][-1]["p99"] is None  # JSON null, not NaN
    assert cert.table().count("**NO**") == 2 and "PAST THE BOUND" in cert.markdown()


def test_stand_in_rewards_alternate_within_each_group():
    batch = [Sample(group_id=g, prompt=[], answer="") for g in (0, 0, 1, 1, 1)]
    stand_in_rewards(batch)
    assert [s.reward for s in batch] == [0.0, 1.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("args, message", [
    (["rollout.dtype=float33"], "rlexp.check: config error: rollout.dtype must be one of"),
    (["--samples", "1"], "rlexp.check: config error: --samples must be an integer >= 2"),
])
def test_a_bad_override_fails_before_any_engine_starts(args, message):
    res = _check(*args, timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and message in res.stderr
    assert "vLLM engine up" not in res.stderr + res.stdout
