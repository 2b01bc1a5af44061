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


@pytest.mark.slow
@pytest.mark.vllm
def test_async_speedup_bench_runs_and_reports_ratios():
    res = subprocess.run([sys.executable, "bench/async_speedup.py", "--steps", "2", "--thresholds", "1"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    rows = {x.split()[0]: x.split()[1:] for x in lines if x.startswith(("sync ", "async_1 "))}
    assert set(rows) == {"sync", "async_1"} and all(len(r) == 15 for r in rows.values())
    assert float(rows["sync"][7]) == 0.0  # staleness_max: sync is on-policy
    assert 0.0 <= float(rows["async_1"][7]) <= 1.0  # and async stays within its bound
    ratio = [x for x in res.stdout.splitlines() if x.startswith("sync/async_1: training loop")]
    assert len(ratio) == 1 and float(ratio[0].split()[3].rstrip("x,")) > 0


def test_vs_trl_bench_says_how_to_install_trl_when_it_is_missing(tmp_path):
    import shutil

    bench = tmp_path / "bench"
    shutil.copytree(ROOT / "bench", bench)  # beside no .venv-trl
    res = subprocess.run([sys.executable, str(bench / "vs_trl.py")], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "scripts/install_trl.sh" in res.stdout and "ratio:" not in res.stdout
