import json
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
        [sys.executable, "bench/rollout_overhead.py", "--reps", "2", "--batches", "1", "--prompts", "4",
         "--samples", "2", "--warm-start-steps", "0", "--max-tokens", "4"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [x for x in res.stdout.splitlines() if x.startswith("rollout throughput ratio")]
    assert len(lines) == 1
    ratio = float(lines[0].rsplit(":", 1)[1])
    assert ratio > 0
    # both paths generated exactly the same number of tokens in every repetition
    rows = [x.split() for x in res.stdout.splitlines() if x.strip()[:1].isdigit() and len(x.split()) == 6]
    assert len(rows) == 2 and all(r[4] == r[5] for r in rows)


# bench/async_speedup.py as a whole is not run here: its smallest form is two whole runs
# (engine start-up and a 100-prompt evaluation each), minutes on 2 cores. Its pinning is.
PINNED_CHILD = """
import json, os, subprocess, sys, threading, time
core, out, depth = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
if depth:  # a process started before the pinning, with a child of its own, as vLLM's engine core
    child = subprocess.Popen([sys.executable, "-c", sys.argv[4], *sys.argv[1:2], out + ".grandchild", "0"])
cores = {}

def wait_for_the_move(name):  # until this thread is moved; after 60 s, report where it is
    deadline = time.monotonic() + 60
    while os.sched_getaffinity(0) != {core} and time.monotonic() < deadline:
        time.sleep(0.01)
    cores[name] = sorted(os.sched_getaffinity(0))

thread = threading.Thread(target=wait_for_the_move, args=("thread",))
thread.start()
wait_for_the_move("main")
thread.join()
if depth:
    child.wait()
open(out, "w").write(json.dumps(cores))
"""


def test_async_speedup_pins_every_thread_of_every_process_the_driver_starts(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from async_speedup import DRIVER_CORE, ENGINE_CORE, pin_descendants

    out = tmp_path / "child.json"
    driver_code = "import subprocess, sys; subprocess.run([sys.executable, '-c', *sys.argv[1:]], check=True)"
    driver = subprocess.Popen(["taskset", "-c", str(DRIVER_CORE), sys.executable, "-c", driver_code,
                               PINNED_CHILD, str(ENGINE_CORE), str(out), "1", PINNED_CHILD])
    seen = pin_descendants(driver, ENGINE_CORE, every_s=0.05)
    assert driver.wait() == 0
    moved = {"main": [ENGINE_CORE], "thread": [ENGINE_CORE]}
    assert json.loads(out.read_text()) == moved  # the engine core's stand-in and a thread it had
    assert json.loads((tmp_path / "child.json.grandchild").read_text()) == moved  # and its own child
    assert seen[driver.pid] == ("driver", {DRIVER_CORE})  # the driver stays where taskset put it
    # what the bench reports: the child on the engine's core (the grandchild may have been born
    # there and gone before a look)
    started = [cores for pid, (_, cores) in seen.items() if pid != driver.pid]
    assert started[:1] == [{ENGINE_CORE}] and all(cores == {ENGINE_CORE} for cores in started)


def test_vs_trl_bench_says_how_to_install_trl_when_it_is_missing(tmp_path):
    import shutil

    bench = tmp_path / "bench"
    shutil.copytree(ROOT / "bench", bench)  # beside no .venv-trl
    res = subprocess.run([sys.executable, str(bench / "vs_trl.py")], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "scripts/install_trl.sh" in res.stdout and "ratio:" not in res.stdout


def test_distill_tokens_counts_the_student_tokens_sampled_until_the_target(tmp_path):
    """bench/distill_tokens.py: tokens are summed over the steps before each evaluation, and
    the target is reached at the first evaluation at or above it."""
    import importlib.util

    from mlflow.tracking import MlflowClient

    spec = importlib.util.spec_from_file_location("distill_tokens", ROOT / "bench" / "distill_tokens.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run_id = client.create_run(client.create_experiment("t")).info.run_id
    for step, tokens in enumerate([100, 120, 90, 110], start=1):
        client.log_metric(run_id, "rollout/tokens", tokens, step=step)
    for step, acc in [(0, 0.2), (2, 0.5), (4, 0.75)]:
        client.log_metric(run_id, "eval/accuracy", acc, step=step)
    points = bench.curve(client, client.get_run(run_id))
    assert points == [(0, 0.0, 0.2), (2, 220.0, 0.5), (4, 420.0, 0.75)]
    assert bench.reached(points, 0.72) == (4, 420.0)
    assert bench.reached(points, 0.5) == (2, 220.0)
    assert bench.reached(points, 0.8) is None
