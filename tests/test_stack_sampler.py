"""bench/stack_sampler.py, the sampler behind bench/step_profile.py's attribution table: its
cells add up to each phase's wall time, work in a thread the main thread waits on is that
work (not idle), and a process whose threads all wait is idle."""

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from stack_sampler import StackSampler, category  # noqa: E402


def spin_torch(until: float) -> None:
    layers, x = torch.nn.Sequential(*[torch.nn.Linear(256, 256), torch.nn.Tanh()] * 8), torch.randn(64, 256)
    with torch.no_grad():
        while time.perf_counter() < until:
            x = layers(x)


def test_phases_add_up_and_waiting_on_a_worker_thread_is_the_workers_work():
    sampler = StackSampler(interval=0.002)
    sampler.start()
    # the phases' bounds as the sampler timed them: a mark taken beside a change would differ
    # from it by however long a loaded machine keeps this thread off a CPU in between
    marks = [sampler.phase("work")]
    with ThreadPoolExecutor(1) as pool:  # as the loop's fit: the main thread waits on it
        pool.submit(spin_torch, time.perf_counter() + 0.3).result()
    marks.append(sampler.phase("wait"))
    threading.Event().wait(0.3)  # nothing of this process works
    marks.append(sampler.phase(None))
    sampler.stop()
    work = {c: s for (p, c), s in sampler.cells.items() if p == "work"}
    wait = {c: s for (p, c), s in sampler.cells.items() if p == "wait"}
    # each phase's cells add up to its wall time: the intervals are split where the phase changed
    assert sum(work.values()) == pytest.approx(marks[1] - marks[0], abs=1e-9)
    assert sum(wait.values()) == pytest.approx(marks[2] - marks[1], abs=1e-9)
    # the worker's torch, not idle although the main thread only waits (how much of it the
    # worker spends on a CPU depends on the machine's load, hence no share asserted)
    assert work.get("torch", 0.0) > 0 and work.get("torch", 0.0) > work.get("other", 0.0)
    assert set(wait) == {"idle"}


def test_a_category_is_the_innermost_library():
    linear = ("/x/torch/nn/modules/linear.py", "forward")
    trainer_calls_torch = [linear, ("/x/rlexp/trainer/policy.py", "forward")]
    mlflow_calls_torch = [linear, ("/x/mlflow/tracking/fluent.py", "log_metrics")]
    judge_calls_re = [("/usr/lib/python3.11/re/__init__.py", "search"),
                      ("/x/rlexp/judges/math_exact.py", "score")]
    assert category(trainer_calls_torch) == "torch"
    assert category(mlflow_calls_torch) == "torch"  # the innermost: where the time is spent
    assert category(judge_calls_re) == "judge"
    assert category([("/x/mlflow/store/db.py", "commit"), ("/x/rlexp/tracking/mlflow_tracker.py", "log")]) \
        == "MLflow logging"
