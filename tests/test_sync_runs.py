"""Whole runs whose weight sync goes wrong: one stops landing (the in-run check stops the run
at the next step, with a checkpoint that resumes), one hangs (sync_timeout_s stops the run and
nothing it started is left running). Planted with the transports in tests/fakes.py."""

import contextlib
import os
import re
import time
from datetime import datetime

import psutil
import pytest

from tests.test_resume import _cmd, _finish, _resume_cmd, _run, _start, _steps
from tests.test_run import _history

BOUND = 1e-3  # trainer.sync_check.bound=auto in float32


@pytest.mark.slow
def test_a_sync_that_stops_landing_stops_the_run_and_its_checkpoint_resumes(tmp_path, run_models, new_store):
    """The transport writes the weights at the first sync only. Step 2 trains on version 1,
    which landed; the engine then serves version 2 with version 1's weights, and step 3's fit
    stops before its optimizer step, saving step 2's checkpoint. Resumed from it with the
    check off (its transport again sends once: the resume's own push of version 2): step 3 is
    healthy, and step 4, after a sync that again did not land, trains on: without the check
    the run would have gone on."""
    store = new_store(tmp_path)
    run_dir, log = tmp_path / "out", tmp_path / "run.log"
    stops = ("rollout=hf", "weight_transfer._target_=tests.fakes.StopsSending", "+weight_transfer.sends=1",
             "trainer.entropy_coef=0.001")  # every step updates the weights (none skipped for lack of signal)
    _finish(_cmd(store, run_dir, run_models, "trainer.total_steps=4", "checkpoint.every_n_steps=0", *stops),
            log, expect=3)
    out = log.read_text()
    assert "rlexp: run stopped: step 3: the weight sync to policy version 2 did not land" in out
    p99, mean = map(float, re.search(r"has p99 ([\d.e-]+), max [\d.e-]+ and mean ([\d.e-]+)", out).groups())
    assert p99 / 10 < mean <= p99  # the engine held older weights: most tokens off, as the message reads it
    assert f"checkpoint of step 2 saved to {run_dir}/checkpoints/step_2" in out
    c, run = _run(store)
    assert run.info.status == "FAILED" and _steps(c, run, "train/loss") == [1, 2]
    healthy = _history(c, run, "sync/logprob_diff_p99")
    assert len(healthy) == 2 and max(healthy) < BOUND / 10
    assert min(_history(c, run, "sync/tokens")) > 0

    _finish(_resume_cmd(run_dir, "trainer.sync_check.bound=off"), log)
    c, run = _run(store)
    assert run.info.status == "FINISHED" and _steps(c, run, "train/loss") == [1, 2, 3, 4]
    p99 = _history(c, run, "sync/logprob_diff_p99")
    assert p99[2] < BOUND / 10 < BOUND < p99[3]  # step 3 after the resume's push; step 4 on stale weights


@pytest.mark.slow
def test_a_transport_that_never_reaches_the_engine_stops_the_run(tmp_path, run_models, new_store):
    """The transport drops the engine's reload unawaited and returns: the engine keeps serving
    version 0, and its tokens say so. Step 2 trains version 1 on them under the sync scheduler
    (staleness must be 0): the run stops before that fit, naming the versions and the cause."""
    store = new_store(tmp_path)
    run_dir, log = tmp_path / "out", tmp_path / "run.log"
    _finish(_cmd(store, run_dir, run_models, "trainer.total_steps=3", "checkpoint.every_n_steps=0",
                 "rollout=hf", "weight_transfer._target_=tests.fakes.NeverReaches"), log, expect=3)
    out = log.read_text()
    assert ("rlexp: run stopped: step 2: policy version 1 was trained on tokens the engine generated at "
            "version 0") in out
    assert "the weight transport did not reach the engine" in out
    c, run = _run(store)
    assert run.info.status == "FAILED" and _steps(c, run, "train/loss") == [1]
    assert "version 0" in run.data.tags["rlexp.error"]
    assert _history(c, run, "rollout/staleness_mean") == [0.0] and min(_history(c, run, "sync/tokens")) > 0


@pytest.mark.slow
@pytest.mark.vllm
def test_a_hung_sync_stops_the_run_and_leaves_nothing_running(tmp_path, run_models, new_store):
    """The engine's reload blocks (its workers open a FIFO as the weights file): past
    sync_timeout_s the run stops with the transport and the engine named, and every process
    it started (vLLM's engine core, hung in the reload, included) is gone."""
    store = new_store(tmp_path)
    run_dir, log = tmp_path / "out", tmp_path / "run.log"
    cmd = _cmd(store, run_dir, run_models, "trainer.total_steps=2", "checkpoint.every_n_steps=0",
               "weight_transfer._target_=tests.fakes.HangsInReload", "sync_timeout_s=5")
    with open(log, "a") as f:
        t0 = time.monotonic()
        proc = _start(cmd, f)  # its own session: every process it starts carries its id
        rc = proc.wait(timeout=600)
    out = log.read_text()
    print(f"run: {time.monotonic() - t0:.1f} s; the hang's error to the exit: {_cleanup_s(out, time.time())}")
    assert rc == 3, out[-4000:]
    assert ("rlexp: run stopped: the weight sync to policy version 1 did not finish in 5 s (sync_timeout_s): "
            "transport HangsInReload, engine VLLMEngine") in out
    running = _still_running(proc.pid)
    assert running == [], [(p.pid, p.info["cmdline"]) for p in running]
    c, run = _run(store)  # what was logged stays; step 1's own metrics would have come after its sync
    assert run.info.status == "FAILED" and _steps(c, run, "eval/accuracy") == [0]


def _still_running(session: int, failsafe_s: float = 60.0) -> list[psutil.Process]:
    """The processes of `session` once they have exited, or those still running after
    `failsafe_s`. Some exit just after the run's process: multiprocessing's resource tracker
    ends when the process it serves has ended. A zombie is a dead process its parent (here:
    the container's init) has not reaped."""
    procs = [p for p in psutil.process_iter(["pid", "status", "cmdline"]) if _session(p.pid) == session]
    deadline = time.monotonic() + failsafe_s
    while True:
        running = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.status() != psutil.STATUS_ZOMBIE:
                    running.append(p)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def _cleanup_s(log: str, exited: float) -> str:
    """Seconds from the logged SyncHung to the run's exit (its cleanup: the engine shut down)."""
    m = re.search(r"\[([\d-]+ [\d:,]+)\]\[rlexp\]\[ERROR\] - weight sync .* hung", log)
    if m is None:
        return "not logged"
    hung = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return f"{exited - hung:.1f} s"
