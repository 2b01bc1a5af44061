"""One OpenEnv episode's connection: a WebSocket on the server's `/ws`, which holds one
environment instance on the server for as long as it is open. `reset` and `step` messages,
each answered with OpenEnv's step result `{"observation": {...}, "reward": r, "done": d}`.
The server process and its pool of these sessions: rlexp/envs/openenv_server.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
from typing import Any, Protocol

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import WebSocketException
from websockets.protocol import State


class OpenEnvError(RuntimeError):
    """The OpenEnv server or an episode's session failed (died, refused, timed out): the
    rollout that holds it fails and is counted; the run goes on."""


class SessionHost(Protocol):
    """What a session reads of its server (OpenEnvServer)."""

    port: int
    step_timeout_s: float
    proc: subprocess.Popen | None

    def describe(self) -> str: ...


class OpenEnvSession:
    """One episode: a WebSocket on the server's `/ws` (one environment instance there)."""

    def __init__(self, server: SessionHost):
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
