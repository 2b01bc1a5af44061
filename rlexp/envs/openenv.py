"""OpenEnv environments, served by OpenEnv's own server in OpenEnv's own venv, stepped by
rlexp over OpenEnv's WebSocket protocol. rlexp never imports openenv.

- `OpenEnvServer`: the server process. `rlexp/envs/openenv_serve.py` run by the OpenEnv venv's
  Python (`create_app` + uvicorn on a free port of 127.0.0.1), ready once `/health` answers,
  with `max_sessions` concurrent sessions. It exits when rlexp does, even when rlexp is
  killed (it watches its stdin, a pipe from rlexp). If it dies, the next session restarts it
  (at most `max_restarts` times); the sessions it held fail with `OpenEnvError`.
- `OpenEnvSession`: one WebSocket on `/ws` (its own environment instance on the server), one
  episode at a time: `reset(**data)`, `step(action)`, each answered with OpenEnv's step result
  `{"observation": {...}, "reward": r, "done": d}`; kept open for the next episode after one
  that ended normally (at most `max_sessions`, in use or not).
- `OpenEnvEnvironment`: the environment-class shape (rlexp/agents/environment.py drives it):
  `reset(**row)` starts a session, one tool (`step` by default) whose parameters are the
  environment's Action schema (from `/schema`), its result the observation as text; `reward`
  is the episode's return (the sum of its steps' rewards), `done` ends the episode.

HTTP `/reset` and `/step` are not used: each of those calls builds a fresh environment, so an
episode's state would not survive from one step to the next."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import selectors
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException
from websockets.protocol import State

from rlexp.errors import ConfigError

log = logging.getLogger(__name__)
SERVE = Path(__file__).with_name("openenv_serve.py")  # the launcher, run by OpenEnv's Python
MAKE_ENVS = "run `make envs` (scripts/install_envs.sh openenv) to create it"


class OpenEnvError(RuntimeError):
    """The OpenEnv server or an episode's session failed (died, refused, timed out): the
    rollout that holds it fails and is counted; the run goes on."""


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
            raise ConfigError(f"{self.describe()}: OpenEnv's Python {self.python} does not exist: "
                              f"{MAKE_ENVS}")
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


class OpenEnvSession:
    """One episode: a WebSocket on the server's `/ws` (one environment instance there)."""

    def __init__(self, server: OpenEnvServer):
        self.server = server
        self.ws: ClientConnection | None = None
        self.port = 0  # of the server it is connected to (a restarted server has another)

    def usable(self) -> bool:
        return self.ws is not None and self.ws.state is State.OPEN and self.port == self.server.port

    def abandon(self) -> None:
        """Drop the connection at once (its loop may be gone)."""
        ws, self.ws = self.ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                ws.transport.abort()

    async def open(self) -> None:
        self.port = self.server.port
        url = f"ws://127.0.0.1:{self.port}/ws"
        try:  # proxy=None: a local server, whatever the proxy settings say
            self.ws = await connect(url, open_timeout=self.server.step_timeout_s, proxy=None,
                                    max_size=16 << 20, ping_interval=None)
        except (OSError, WebSocketException, asyncio.TimeoutError) as e:
            raise self._gone(e) from e

    async def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None:
            with contextlib.suppress(OSError, WebSocketException, asyncio.TimeoutError):
                # the server closes the socket on this message: wait for that rather than race it
                await ws.send(json.dumps({"type": "close"}))
                await asyncio.wait_for(ws.wait_closed(), 2.0)
            with contextlib.suppress(OSError, WebSocketException, asyncio.TimeoutError):
                await asyncio.wait_for(ws.close(), 2.0)

    def _gone(self, e: BaseException) -> OpenEnvError:
        proc = self.server.proc
        code = proc.poll() if proc is not None else None
        state = "is running" if code is None else f"exited with code {code}"
        return OpenEnvError(f"{self.server.describe()} session failed ({type(e).__name__}: {e}); "
                            f"the server {state}")

    async def request(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """Send one message; the step result it is answered with. An error the environment
        reports for this message (a bad action) is a ValueError with its message; a session
        or server failure is an OpenEnvError."""
        assert self.ws is not None, "open() first"
        try:
            await self.ws.send(json.dumps({"type": kind, "data": data}))
            reply = json.loads(await asyncio.wait_for(self.ws.recv(), self.server.step_timeout_s))
        except asyncio.TimeoutError:
            raise OpenEnvError(f"{self.server.describe()}: no answer to {kind} within "
                               f"{self.server.step_timeout_s:g}s (agent.step_timeout_s)") from None
        except (OSError, WebSocketException, json.JSONDecodeError) as e:
            raise self._gone(e) from e
        if reply.get("type") == "error":
            error = reply.get("data") or {}
            code, message = error.get("code"), error.get("message", "")
            if code in ("VALIDATION_ERROR", "EXECUTION_ERROR", "INVALID_JSON"):  # this action's fault
                details = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                                    for e in error.get("errors") or [])
                raise ValueError(f"{message}{': ' + details if details else ''}")
            raise OpenEnvError(f"{self.server.describe()}: {code}: {message}")
        return reply.get("data") or {}


def observation_text(observation: dict[str, Any]) -> str:
    """An observation's fields as the policy reads them: its one field's text when it has
    exactly one, else the fields as JSON."""
    if len(observation) == 1:
        (value,) = observation.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(observation, ensure_ascii=False)


def action_tool_spec(action_schema: dict[str, Any], name: str) -> dict[str, Any]:
    """The OpenAI tool spec of a step: the Action schema less its `metadata` (rlexp's own
    business, never the policy's), its docstring as the description."""
    properties = {k: v for k, v in (action_schema.get("properties") or {}).items() if k != "metadata"}
    parameters = {"type": "object", "properties": properties,
                  "required": [k for k in action_schema.get("required", []) if k in properties]}
    if "$defs" in action_schema:
        parameters["$defs"] = action_schema["$defs"]
    description = action_schema.get("description") or "Take one action in the environment."
    return {"type": "function",
            "function": {"name": name, "description": description, "parameters": parameters}}


class OpenEnvEnvironment:
    """An OpenEnv episode in the environment-class shape: `reset(**row)` opens a session and
    resets it with the dataset row (the environment's `reset` takes the keys it names);
    `step(**action)` is the one tool (named `tool_name` for the policy); `reward` sums the
    steps' rewards; `done` is the last step's. `close()` ends the session."""

    def __init__(self, server: OpenEnvServer, tool_name: str = "step"):
        self.server = server
        self.tool_schemas = {"step": action_tool_spec(server.action_schema, tool_name)}
        self.reward, self.done, self.steps = 0.0, False, 0
        self._session: contextlib.AbstractAsyncContextManager[OpenEnvSession] | None = None
        self._ws: OpenEnvSession | None = None

    async def reset(self, **row: Any) -> str | None:
        session = self.server.session()
        self._ws = await session.__aenter__()
        self._session = session
        result = await self._ws.request("reset", _jsonable(row))
        self.reward, self.done = _reward(result), bool(result.get("done"))
        text = observation_text(result.get("observation") or {})
        return text or None

    async def step(self, **action: Any) -> str:
        if self._ws is None:
            raise OpenEnvError("step before reset")
        if self.done:
            return "error: the episode is over"
        result = await self._ws.request("step", action)
        self.steps += 1
        self.reward += _reward(result)
        self.done = bool(result.get("done"))
        return observation_text(result.get("observation") or {})

    async def close(self) -> None:
        session, self._session, self._ws = self._session, None, None
        if session is not None:
            await session.__aexit__(None, None, None)


def _reward(result: dict[str, Any]) -> float:
    reward = result.get("reward")
    if reward is None:
        return 0.0
    if isinstance(reward, bool):  # an Observation's reward may be one
        return float(reward)
    if not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise OpenEnvError(f"the environment's reward is not a finite number: {reward!r}")
    return float(reward)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """The row's JSON-serialisable keys (a prompt's images are left out)."""
    out = {}
    for key, value in row.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


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
