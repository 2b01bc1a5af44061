"""The OpenEnv server process and its sessions: `rlexp/envs/openenv_serve.py` run by the
OpenEnv venv's Python (`create_app` + uvicorn on a free port of 127.0.0.1), ready once
`/health` answers, with `max_sessions` concurrent sessions (rlexp/envs/openenv_session.py). It
exits when rlexp does, even when rlexp is killed (it watches its stdin, a pipe from rlexp). If
it dies, the next session restarts it (at most `max_restarts` times); the sessions it held
fail with `OpenEnvError`. `shared_server` / `release`: one server per run, shared by the
training and the evaluation agents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import selectors
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from rlexp.envs.openenv_session import OpenEnvError, OpenEnvSession
from rlexp.errors import ConfigError

log = logging.getLogger(__name__)
SERVE = Path(__file__).with_name("openenv_serve.py")  # the launcher, run by OpenEnv's Python
MAKE_ENVS = "run `make envs` (scripts/install_envs.sh openenv) to create it"


class OpenEnvServer:
    """One OpenEnv server process for `environment` ("package.module:Class" of an OpenEnv
    `Environment` subclass, or "package.module:app" of a FastAPI app made with `create_app`).
    `python`: the OpenEnv venv's interpreter. `start()` blocks until it is ready (or raises
    ConfigError with the reason, one line, after at most `start_timeout_s`)."""

    def __init__(self, environment: str, python: str, max_sessions: int = 64, start_timeout_s: float = 60.0,
                 step_timeout_s: float = 60.0, max_restarts: int = 3):
        self.environment, self.python = environment, python
        self.max_sessions, self.start_timeout_s = max_sessions, start_timeout_s
        self.step_timeout_s, self.max_restarts = step_timeout_s, max_restarts
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.restarts = 0
        self.action_schema: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: list[OpenEnvSession] = []
        self._slots: asyncio.Semaphore | None = None
        self._restarting: asyncio.Lock | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> str:
        return f"OpenEnv server for {self.environment}"

    # ---- the process ------------------------------------------------------------------
    def start(self) -> None:
        """Start the server and wait until `/health` answers; read the Action schema."""
        if not Path(self.python).is_file():
            raise ConfigError(f"{self.describe()}: OpenEnv's Python {self.python} (agent.python) does not "
                              f"exist: {MAKE_ENVS}, or set agent.python=/path/to/venv/bin/python")
        path = os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))  # the env's module
        env = os.environ | {"ENABLE_WEB_INTERFACE": "false", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
        # stdin: a pipe the server reads until it closes, i.e. until this process is gone
        self.proc = subprocess.Popen([self.python, str(SERVE), self.environment,
                                      "--max-sessions", str(self.max_sessions)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            first = self._first_line(deadline)
            if "error" in first:
                raise ConfigError(f"{self.describe()} did not start: {first['error']}")
            self.port = int(first["port"])
            with httpx.Client(base_url=self.base_url, timeout=5.0, trust_env=False) as http:
                while True:
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get("/health").status_code == 200:
                            break
                    self._check_running(deadline)
                    time.sleep(0.05)
                schema = http.get("/schema")
                schema.raise_for_status()
                self.action_schema = schema.json()["action"]
        except BaseException:
            self.stop()
            raise
        log.info("%s: pid %d on %s, %d sessions at once", self.describe(), self.proc.pid, self.base_url,
                 self.max_sessions)

    def _first_line(self, deadline: float) -> dict[str, Any]:
        """The launcher's first stdout line (its port, or why it cannot serve)."""
        assert self.proc is not None and self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while not sel.select(timeout=0.1):
                self._check_running(deadline)
        line = self.proc.stdout.readline()
        if not line:  # it exited before a word
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5.0)
            self._check_running(deadline)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise ConfigError(f"{self.describe()} did not start: it wrote {line[:200]!r}") from None

    def _check_running(self, deadline: float) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ConfigError(f"{self.describe()} exited with code {self.proc.returncode} before it was "
                              f"ready (its stderr is above)")
        if time.monotonic() > deadline:
            raise ConfigError(f"{self.describe()} was not ready within {self.start_timeout_s:g}s "
                              "(agent.start_timeout_s)")

    def stop(self) -> None:
        """Close its stdin (it exits on that), then terminate or kill it if it lingers."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        for signal in (None, proc.terminate, proc.kill):
            if signal is not None:
                signal()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(3.0)
                return

    # ---- sessions ---------------------------------------------------------------------
    def _bind(self) -> None:
        """This event loop's session slots and idle sessions (asyncio objects and connections
        belong to one loop; a run has one, tests may have several in turn)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            for idle in self._idle:
                idle.abandon()
            self._loop, self._restarting, self._idle = loop, asyncio.Lock(), []
            self._slots = asyncio.Semaphore(self.max_sessions)

    async def _ensure_running(self) -> None:
        """Restart a server that died (at most `max_restarts` times in all)."""
        assert self._restarting is not None
        async with self._restarting:
            if self.alive():
                return
            code = None if self.proc is None else self.proc.poll()
            if self.restarts >= self.max_restarts:
                raise OpenEnvError(f"{self.describe()} is gone (exit code {code}) and was restarted "
                                   f"{self.restarts} times already (agent.max_restarts)")
            self.restarts += 1
            log.warning("%s exited (code %s): restarting it (%d of at most %d)", self.describe(), code,
                        self.restarts, self.max_restarts)
            self.stop()
            try:
                await asyncio.to_thread(self.start)
            except ConfigError as e:
                raise OpenEnvError(str(e)) from e

    @contextlib.asynccontextmanager
    async def session(self):
        """An `OpenEnvSession` held for the `async with` block; waits for a free slot when
        `max_sessions` are in use, so the server is never asked for more than it holds. A
        session whose block ended normally is kept open for the next episode (its `reset`
        starts one, as OpenEnv's own client does): a new session costs a connection and an
        environment instance on the server, several times a reset's time."""
        self._bind()
        assert self._slots is not None
        async with self._slots:
            await self._ensure_running()
            session = self._reusable()
            if session is None:
                session = OpenEnvSession(self)
                await session.open()
            kept = False
            try:
                yield session
                kept = session.usable()
            finally:
                if kept:
                    self._idle.append(session)
                else:
                    await session.close()

    def _reusable(self) -> OpenEnvSession | None:
        while self._idle:
            session = self._idle.pop()
            if session.usable():
                return session
            session.abandon()
        return None

    async def aclose_idle(self) -> None:
        """Close the sessions kept for reuse (on the loop that holds them)."""
        self._bind()
        idle, self._idle = self._idle, []
        await asyncio.gather(*(session.close() for session in idle))


_SHARED: dict[tuple, tuple[OpenEnvServer, int]] = {}
_SHARED_LOCK = threading.Lock()


def shared_server(environment: str, python: str, **kwargs: Any) -> OpenEnvServer:
    """The run's server for these settings, started on first use: the training and the
    evaluation agents share it. Give it back with `release`."""
    key = (environment, os.path.abspath(python), *sorted(kwargs.items()))
    with _SHARED_LOCK:
        server, users = _SHARED.get(key, (None, 0))
        if server is None:
            server = OpenEnvServer(environment, python, **kwargs)
            server.start()
        _SHARED[key] = (server, users + 1)
        return server


def release(server: OpenEnvServer) -> None:
    """One user fewer; the last one stops the server."""
    with _SHARED_LOCK:
        for key, (held, users) in list(_SHARED.items()):
            if held is server:
                if users > 1:
                    _SHARED[key] = (held, users - 1)
                    return
                del _SHARED[key]
        server.stop()
