"""SIGTERM (`kill`, `scancel`, SLURM's time limit) and SIGINT (Ctrl-C) stop a run that is under
way as a stop from inside it does: the MLflow run ends KILLED with the signal named in
`rlexp.error`, the resume command is printed, nothing the run started is left running, and
the exit code is 128 + the signal's number (rlexp/signals.py)."""

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from rlexp.rollout import reaper
from tests.processes import running_cmdline
from tests.test_resume import _cmd, _run, _start, _wait_for

SENT = {  # how each signal reaches the run, as it does outside a test
    "kill": lambda pid, sig: os.kill(pid, sig),  # `kill <pid>`: the main process alone
    "ctrl-c": lambda pid, sig: os.killpg(pid, sig),  # a terminal: the whole foreground group
}


def _signal_mid_run(cmd, log: Path, run_dir: Path, sig: signal.Signals, how: str):
    """Start `cmd`; once its step-1 checkpoint is written (the run is under way: its engine up,
    step 2 started), send `sig` `how` the user's side would. Returns the exit code, what the
    run printed, and the run's processes (with their command lines) when the signal went."""
    with open(log, "a") as f:
        proc = _start(cmd, f)  # its own session and process group
        try:
            _wait_for(run_dir / "checkpoints" / "step_1" / "meta.json", proc)
            tree = psutil.Process(proc.pid).children(recursive=True)
            started = " | ".join(c for c in map(running_cmdline, tree) if c is not None)
            SENT[how](proc.pid, sig)
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, log.read_text(), tree, started


def _left_running(tree: list[psutil.Process], failsafe_s: float = 60.0) -> list[str]:
    """The command lines of those of `tree` still running once none is, or after `failsafe_s`
    (multiprocessing's resource tracker exits just after the process it serves). A zombie
    (dead, not yet reaped by its new parent) is not running."""
    deadline = time.monotonic() + failsafe_s
    while True:
        running = [c for c in map(running_cmdline, tree) if c is not None]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "how", "rollout"), [
    pytest.param(signal.SIGTERM, "kill", "vllm", marks=pytest.mark.vllm, id="SIGTERM-kill-vllm"),
    pytest.param(signal.SIGINT, "ctrl-c", "hf", id="SIGINT-ctrl-c-hf"),
])
def test_a_signal_stops_the_run_killed_with_its_resume_command_and_nothing_left(
        tmp_path, run_models, new_store, sig, how, rollout):
    store = new_store(tmp_path)
    run_dir, log = tmp_path / "out", tmp_path / "run.log"
    cmd = _cmd(store, run_dir, run_models, "trainer.total_steps=100", f"rollout={rollout}")
    rc, out, tree, started = _signal_mid_run(cmd, log, run_dir, sig, how)
    assert rc == 128 + sig.value, out[-4000:]
    if rollout == "vllm":  # the engine core and its reaper were running, and are gone below
        assert "EngineCore" in started and "rlexp.rollout.reaper" in started, started
    sender = {"SIGTERM": "kill, scancel or SLURM's time limit", "SIGINT": "Ctrl-C"}[sig.name]
    assert f"rlexp: run stopped: {sig.name} ({sender}) stopped the run; last checkpoint: step " in out
    assert f"Resume: python -m rlexp.run resume={run_dir}\n" in out
    assert _left_running(tree) == []
    _, run = _run(store)
    assert run.info.status == "KILLED"
    assert run.data.tags["rlexp.error"].startswith(f"Interrupted: {sig.name} ({sender}) stopped the run")


def _engine_starting(proc, log: Path) -> list[psutil.Process]:
    """Stop `proc` (SIGSTOP) once vLLM's engine core runs but the engine is not up yet (its
    pids not yet sent to the reaper), the core older than the reaper's polling window (it
    takes seconds to start). Returns the core's processes."""
    while True:
        assert proc.poll() is None, "the run exited before its engine started"
        assert "vLLM engine up" not in log.read_text(), "the engine was up before its start was seen"
        tree = psutil.Process(proc.pid).children(recursive=True)
        core = [p for p in tree if "EngineCore" in (running_cmdline(p) or "")]
        if core and time.time() - core[0].create_time() > 5 * reaper.POLL_S:
            proc.send_signal(signal.SIGSTOP)
            assert "vLLM engine up" not in log.read_text(), "the engine came up meanwhile"
            tree = psutil.Process(proc.pid).children(recursive=True)
            return [p for p in tree if "EngineCore" in (running_cmdline(p) or "")]
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_killed_while_its_engine_starts_leaves_no_engine_running(tmp_path, run_models, new_store):
    """SIGKILL (a dying node) while vLLM's engine core starts, before rlexp can list its
    processes: the reaper, started first, finds and kills them (rlexp/rollout/reaper.py)."""
    store = new_store(tmp_path)
    log = tmp_path / "run.log"
    cmd = _cmd(store, tmp_path / "out", run_models, "rollout=vllm")
    with open(log, "a") as f:
        proc = _start(cmd, f)
        try:
            core = _engine_starting(proc, log)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            gone, alive = psutil.wait_procs(core, timeout=20)
            assert core and not alive, [running_cmdline(p) for p in alive]
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
