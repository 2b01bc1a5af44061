"""Environments in their own Python (rlexp/envs/process.py): the child-process protocol with a
trivial child (stdlib only): the handshake, concurrent requests, errors and cancellation, a
child that dies mid-request and is restarted, startup failures, and a parent that dies. Real
verifiers environments on this protocol: test_verifiers_env.py."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlexp.envs.process import ChildProcess, EnvProcessError, EnvRequestError

ROOT = Path(__file__).resolve().parents[1]
CHILD_PY = ROOT / "rlexp" / "envs" / "child.py"
FAILSAFE_S = 60  # a test coroutine that never returns becomes a failure, not a hang
FOREVER_S = 3600  # a child's sleep that outlasts the failsafe: what ends it must be what is tested


# A trivial child (stdlib only, any Python): the protocol's child side, loaded by its path.
TRIVIAL_CHILD = textwrap.dedent("""
    import asyncio, importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("_child", sys.argv[1])
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    mode = sys.argv[2] if len(sys.argv) > 2 else ""
    cancelled = []

    async def setup():
        print("noise on stdout before the handshake goes to stderr")
        if mode == "bad":
            raise ImportError("No module named 'my_env'")
        if mode == "slow":
            await asyncio.sleep(3600)  # past the test's failsafe: only the startup timeout ends it
        return {"pid": os.getpid()}

    async def echo(params):
        print("noise on stdout during a request")
        return params

    async def sleep(params):
        try:
            await asyncio.sleep(params["s"])
        except asyncio.CancelledError:
            cancelled.append(1)
            raise
        return params["s"]

    arrived = []
    all_arrived = asyncio.Event()

    async def barrier(params):  # returns once params["n"] requests are in: never if served one by one
        arrived.append(1)
        if len(arrived) == params["n"]:
            all_arrived.set()
        await all_arrived.wait()
        return len(arrived)

    async def boom(params):
        raise ValueError("the env said no")

    async def die(params):
        print("dying now", file=sys.stderr, flush=True)
        await asyncio.sleep(0.2)
        os._exit(3)

    async def n_cancelled(params):
        return len(cancelled)

    sys.exit(child.serve(setup, {"echo": echo, "sleep": sleep, "barrier": barrier, "boom": boom,
                                 "die": die, "n_cancelled": n_cancelled}))
""")


@pytest.fixture
def child_script(tmp_path) -> Path:
    path = tmp_path / "trivial_child.py"
    path.write_text(TRIVIAL_CHILD)
    return path


def _child(script: Path, mode: str = "", **kw) -> ChildProcess:
    return ChildProcess("test env", [sys.executable, str(script), str(CHILD_PY), mode], **kw)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, FAILSAFE_S))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_handshake_concurrency_and_errors(child_script):
    async def go():
        child = _child(child_script)
        try:
            info = await child.start()
            assert info["pid"] == child.pid
            # what the child prints to stdout is not the protocol's
            assert await child.request("echo", {"x": [1, "a"]}) == {"x": [1, "a"]}
            # concurrent, not one by one: each returns only once all 20 are in the child
            results = await asyncio.gather(*(child.request("barrier", {"n": 20}) for _ in range(20)))
            assert results == [20] * 20
            with pytest.raises(EnvRequestError, match="test env: ValueError: the env said no") as e:
                await child.request("boom")
            assert e.value.remote_type == "ValueError"
            with pytest.raises(EnvRequestError, match="unknown op"):
                await child.request("nope")
            with pytest.raises(EnvProcessError, match="no answer to 'sleep' within 0.2s"):
                await child.request("sleep", {"s": 30}, timeout_s=0.2)
            task = asyncio.create_task(child.request("sleep", {"s": 30}))
            await asyncio.sleep(0.3)
            task.cancel()  # a guard's timeout: the request is cancelled in the child too
            await asyncio.sleep(0.3)
            assert await child.request("n_cancelled") == 2
            assert child.starts == 1
            pid = child.pid
        finally:
            await child.aclose()
        assert not _alive(pid)
        with pytest.raises(EnvProcessError, match="closed"):
            await child.request("echo")

    _run(go())


def test_child_death_fails_requests_in_flight_then_restarts(child_script):
    async def go():
        child = _child(child_script, max_restarts=1)
        try:
            await child.start()
            first_pid = child.pid
            # sleeps past the failsafe: only the child's death can end them
            in_flight = [asyncio.create_task(child.request("sleep", {"s": FOREVER_S})) for _ in range(3)]
            await asyncio.sleep(0.2)
            with pytest.raises(EnvProcessError) as e:
                await child.request("die")
            message = str(e.value)
            assert "test env" in message and "exited with status 3" in message and "dying now" in message
            for task in in_flight:
                with pytest.raises(EnvProcessError, match="exited with status 3"):
                    await task
            # the next request restarts the child (max_restarts=1: once)
            assert await child.request("echo", {"again": True}) == {"again": True}
            assert child.starts == 2 and child.pid != first_pid
            with pytest.raises(EnvProcessError):
                await child.request("die")
            with pytest.raises(EnvProcessError, match="restarted 1 times already: not again"):
                await child.request("echo")  # from now on without trying to start the child
            assert child.starts == 2
        finally:
            await child.aclose()

    _run(go())


def test_startup_failures_are_clear_and_bounded(child_script):
    async def go():
        bad = _child(child_script, "bad")
        with pytest.raises(EnvProcessError, match=r"^test env: ImportError: No module named 'my_env'$"):
            await bad.request("echo")
        with pytest.raises(EnvProcessError, match="my_env"):  # not restarted: it would fail the same way
            await bad.request("echo")
        assert bad.starts == 1
        await bad.aclose()
        slow = _child(child_script, "slow", startup_timeout_s=1.0)
        with pytest.raises(EnvProcessError, match=r"no handshake within 1s .*noise on stdout before"):
            await slow.start()  # its setup sleeps past the failsafe
        assert slow.pid is not None and not _alive(slow.pid)
        await slow.aclose()
        missing = ChildProcess("test env", ["/nonexistent/python", "x"])
        with pytest.raises(FileNotFoundError):
            await missing.start()

    _run(go())


PARENT = textwrap.dedent("""
    import asyncio, sys
    sys.path.insert(0, sys.argv[1])
    from rlexp.envs.process import ChildProcess

    async def main():
        child = ChildProcess("test env", [sys.executable, sys.argv[2], sys.argv[3]])
        info = await child.start()
        print(info["pid"], flush=True)
        await child.request("sleep", {"s": 600})

    asyncio.run(main())
""")


@pytest.mark.parametrize("how", ["sigkill", "stdin_closed"])
def test_the_child_never_outlives_its_parent(child_script, tmp_path, how):
    """The child exits when its stdin closes: rlexp SIGKILLed closes it too."""
    if how == "stdin_closed":
        proc = subprocess.Popen([sys.executable, str(child_script), str(CHILD_PY)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        hello = json.loads(proc.stdout.readline())
        pid = hello["info"]["pid"]
        proc.stdin.write(b'{"id": 1, "op": "sleep", "params": {"s": 600}}\n')
        proc.stdin.flush()
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0  # the request in flight is cancelled; a clean exit
        return
    parent_py = tmp_path / "parent.py"
    parent_py.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(parent_py), str(ROOT), str(child_script), str(CHILD_PY)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    pid = int(parent.stdout.readline())
    assert _alive(pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the child outlived its SIGKILLed parent"
