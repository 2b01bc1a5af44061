"""A child process running another Python (an environment library's own venv, whose pins
the main one cannot hold), spoken to in JSON lines over its stdin and stdout, many requests
at once (each tagged with an id), from asyncio:

    child = ChildProcess("verifiers env vf_arith", [".venv-verifiers/bin/python", script, ...])
    info = await child.start()                 # the child's handshake (bounded: startup_timeout_s)
    result = await child.request("episode", {...})   # concurrently, from many tasks
    await child.aclose()                       # closes stdin; the child exits

The child's side is rlexp/envs/child.py (stdlib only, loaded by its path), which states the
protocol. Every wait here ends: the handshake by `startup_timeout_s`, a request by its answer,
by the child's death, or by `timeout_s` where one is given; closing by `close_timeout_s`, then
SIGTERM, then SIGKILL.

Lifetime: the child reads stdin until it closes and then exits, so it never outlives rlexp
(a SIGKILL of rlexp closes the pipe too). It runs in its own session, so a Ctrl-C at the
terminal reaches rlexp alone, which then closes it.

Failure: a child that dies fails every request in flight with `EnvProcessError` naming the
child, its exit status and its last stderr lines (an agent's exception: the sample is a
counted failure and the run goes on, rlexp/guards.py). The next request starts a fresh child,
at most `max_restarts` times over the object's life; after that, and after a handshake that
reported a failure (`{"ready": false}`: the environment cannot be loaded, which a restart
would not change), every request fails at once with the reason. A request the child answers
with an error raises `EnvRequestError` (the child stays up)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)
LINE_LIMIT = 64 << 20  # bytes in one answer line (a task list can be long)


class EnvProcessError(RuntimeError):
    """The environment's child process failed: it died, did not start, or was closed."""


class EnvRequestError(RuntimeError):
    """The child answered a request with an error (`remote_type`: the exception's class there)."""

    def __init__(self, message: str, remote_type: str = ""):
        super().__init__(message)
        self.remote_type = remote_type


class ChildProcess:
    """`argv`: the child's command (its Python first); `env`: its environment (None: rlexp's);
    `name`: how errors name it ("verifiers env vf_arith")."""

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 cwd: str | None = None, startup_timeout_s: float = 120.0, close_timeout_s: float = 15.0,
                 max_restarts: int = 3, stderr_lines: int = 30):
        self.name, self.argv, self.env, self.cwd = name, list(argv), env, cwd
        self.startup_timeout_s, self.close_timeout_s = startup_timeout_s, close_timeout_s
        self.max_restarts = max_restarts
        self.info: dict[str, Any] = {}
        self.starts = 0  # children started (the first and every restart)
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._stderr_task: asyncio.Task | None = None
        self._stderr: deque[str] = deque(maxlen=stderr_lines)
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._start_lock = asyncio.Lock()
        self._write_lock = asyncio.Lock()
        self._fatal: str | None = None  # set: every request fails at once with it
        self._last_death: str | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    def stderr_tail(self) -> str:
        return " | ".join(self._stderr)

    def _reason(self, what: str) -> str:
        tail = self.stderr_tail()
        return f"{self.name}: {what}" + (f"; its last stderr lines: {tail}" if tail else "")

    async def start(self) -> dict[str, Any]:
        """The running child's handshake info, starting (or restarting) it if needed."""
        async with self._start_lock:
            if self._closed:
                raise EnvProcessError(f"{self.name}: closed")
            if self._fatal is not None:
                raise EnvProcessError(self._fatal)
            if self.running and self._reader is not None and not self._reader.done():
                return self.info
            if self._reader is not None:  # the child died: its reader is failing its requests
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._reader), 15.0)
            if self.starts > self.max_restarts:
                self._fatal = (f"{self._last_death or self.name + ': died'} (restarted {self.max_restarts} "
                               f"times already: not again)")
                raise EnvProcessError(self._fatal)
            return await self._spawn()

    async def _spawn(self) -> dict[str, Any]:
        self.starts += 1
        self._stderr.clear()
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=dict(self.env) if self.env is not None else None,
            cwd=self.cwd, start_new_session=True, limit=LINE_LIMIT)
        self._proc = proc
        self._stderr_task = stderr = asyncio.create_task(self._read_stderr(proc))
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), self.startup_timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            await self._kill(proc)
            raise EnvProcessError(self._reason(f"no handshake within {self.startup_timeout_s:g}s "
                                               f"(startup_timeout_s)")) from None
        except ValueError:  # a line over LINE_LIMIT
            await self._kill(proc)
            raise EnvProcessError(self._reason("its handshake line is over the size limit")) from None
        if not line:
            code = await self._exit_code(proc, stderr)
            raise EnvProcessError(self._reason(f"exited with status {code} while starting"))
        try:
            hello = json.loads(line)
        except ValueError:
            await self._kill(proc)
            raise EnvProcessError(self._reason(f"its first line is not the handshake: {line[:200]!r} "
                                               f"(does something print to stdout before it?)")) from None
        if not isinstance(hello, dict) or not hello.get("ready"):
            error = hello.get("error") if isinstance(hello, dict) else None
            await self._kill(proc)
            self._fatal = f"{self.name}: {error or 'failed to start'}"
            raise EnvProcessError(self._fatal)
        self.info = hello.get("info") or {}
        self._reader = asyncio.create_task(self._read(proc, stderr))
        return self.info

    async def request(self, op: str, params: Mapping[str, Any] | None = None,
                      timeout_s: float | None = None) -> Any:
        """The child's answer to `op`; concurrent requests are fine. Cancelling the caller
        (a guard's timeout) cancels the request in the child too."""
        await self.start()
        proc = self._proc
        assert proc is not None
        rid = next(self._ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending[rid] = future
        try:
            if self._reader is None or self._reader.done():  # died between start() and now
                raise EnvProcessError(self._last_death or self._reason("not running"))
            await self._send(proc, {"id": rid, "op": op, "params": dict(params or {})})
            if timeout_s is None:
                return await future
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            self._cancel_in_child(proc, rid)
            raise EnvProcessError(f"{self.name}: no answer to {op!r} within {timeout_s:g}s") from None
        except asyncio.CancelledError:
            self._cancel_in_child(proc, rid)
            raise
        finally:
            self._pending.pop(rid, None)

    async def _send(self, proc: asyncio.subprocess.Process, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        async with self._write_lock:
            stdin = proc.stdin
            if stdin is None or stdin.is_closing() or proc.returncode is not None:
                raise EnvProcessError(self._last_death or self._reason("not running"))
            stdin.write(data)
            try:
                await stdin.drain()  # returns, or raises when the child dies
            except (BrokenPipeError, ConnectionResetError):
                raise EnvProcessError(self._last_death or self._reason("its stdin closed")) from None

    def _cancel_in_child(self, proc: asyncio.subprocess.Process, rid: int) -> None:
        stdin = proc.stdin
        if stdin is not None and not stdin.is_closing() and proc.returncode is None:
            with contextlib.suppress(Exception):
                stdin.write((json.dumps({"cancel": rid}) + "\n").encode())

    async def _read_stderr(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        with contextlib.suppress(Exception):
            while True:
                try:
                    line = await proc.stderr.readline()
                except ValueError:  # a line over the limit: keep its start
                    line = b"(a stderr line over the size limit)"
                if not line:
                    return
                text = line.decode(errors="replace").rstrip()
                if text:
                    self._stderr.append(text[:500])
                    log.debug("%s: %s", self.name, text)

    async def _read(self, proc: asyncio.subprocess.Process, stderr: asyncio.Task) -> None:
        """Answers to their requests until stdout closes; then every request in flight fails
        with the child's death."""
        assert proc.stdout is not None
        problem = ""
        try:
            while True:
                try:
                    line = await proc.stdout.readline()
                except ValueError:
                    problem = "answered a line over the size limit"
                    break
                if not line:
                    break
                try:
                    message = json.loads(line)
                except ValueError:
                    self._stderr.append(f"(on stdout, not JSON) {line[:200]!r}")
                    continue
                rid = message.get("id") if isinstance(message, dict) else None
                future = self._pending.get(rid) if isinstance(rid, int) else None
                if future is None or future.done():
                    continue
                if message.get("ok"):
                    future.set_result(message.get("result"))
                else:
                    remote = str(message.get("type") or "")
                    future.set_exception(EnvRequestError(f"{self.name}: {message.get('error')}", remote))
        finally:
            if problem:
                await self._kill(proc)
            code = await self._exit_code(proc, stderr)
            reason = problem or ("was closed" if self._closed else f"exited with status {code}")
            self._last_death = self._reason(f"the child process {reason}")
            for future in list(self._pending.values()):
                if not future.done():
                    future.set_exception(EnvProcessError(self._last_death))
            if not self._closed:
                log.warning("%s", self._last_death)

    async def _exit_code(self, proc: asyncio.subprocess.Process, stderr: asyncio.Task,
                         wait_s: float = 5.0) -> int | None:
        """The exit status of a child whose stdout closed (killed if it lingers), with its
        stderr read to the end (bounded) so that the error message has its last lines."""
        try:
            await asyncio.wait_for(proc.wait(), wait_s)
        except asyncio.TimeoutError:
            await self._kill(proc)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(stderr), 2.0)
        return proc.returncode

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        """SIGKILL the child's process group (its own session: pgid == pid) and reap it."""
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), 5.0)

    async def aclose(self) -> None:
        """Close the child's stdin and wait for it to exit (`close_timeout_s`), then SIGTERM,
        then SIGKILL. Requests in flight fail; later ones raise."""
        self._closed = True
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            if proc.stdin is not None:
                with contextlib.suppress(Exception):
                    proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), self.close_timeout_s)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 5.0)
                except asyncio.TimeoutError:
                    await self._kill(proc)
        for task in (self._reader, self._stderr_task):
            if task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, 5.0)
        self._reader = self._stderr_task = None
