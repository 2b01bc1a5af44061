import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.vllm
def test_rollout_overhead_bench_runs_and_reports_a_ratio():
    res = subprocess.run(
        [sys.executable, "bench/rollout_overhead.py", "--reps", "2", "--prompts", "4", "--samples", "2",
         "--warm-start-steps", "0", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [x for x in res.stdout.splitlines() if x.startswith("rollout throughput ratio")]
    assert len(lines) == 1
    ratio = float(lines[0].rsplit(":", 1)[1])
    assert ratio > 0
    # both paths generated exactly the same number of tokens in every repetition
    rows = [x.split() for x in res.stdout.splitlines() if x.strip()[:1].isdigit() and len(x.split()) == 6]
    assert len(rows) == 2 and all(r[4] == r[5] for r in rows)
