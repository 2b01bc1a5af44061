"""OpenEnv environments, served by OpenEnv's own server in OpenEnv's own venv, stepped by
rlexp over OpenEnv's WebSocket protocol. rlexp never imports openenv.

- `OpenEnvServer` (rlexp/envs/openenv_server.py): the server process, and its sessions.
- `OpenEnvSession` (rlexp/envs/openenv_session.py): one WebSocket on `/ws` (its own
  environment instance on the server), one episode at a time; kept open for the next episode
  after one that ended normally (at most `max_sessions`, in use or not).
- `OpenEnvEnvironment` (here): the environment-class shape (rlexp/agents/environment.py drives it):
  `reset(**row)` starts a session, one tool (`step` by default) whose parameters are the
  environment's Action schema (from `/schema`), its result the observation as text; `reward`
  is the episode's return (the sum of its steps' rewards), `done` ends the episode.

HTTP `/reset` and `/step` are not used: each of those calls builds a fresh environment, so an
episode's state would not survive from one step to the next."""

from __future__ import annotations

import contextlib
import json
import math
from typing import Any

from rlexp.envs.openenv_server import OpenEnvServer
from rlexp.envs.openenv_session import OpenEnvError, OpenEnvSession


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
