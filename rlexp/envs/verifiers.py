"""How rlexp starts a verifiers environment's worker (rlexp/envs/verifiers_worker.py) in
verifiers' own venv: the data source lists the env's tasks with a one-shot run (`list_tasks`,
in preflight), the agent keeps one worker for its episodes (`worker`, a ChildProcess).

verifiers is never imported here: it lives in `.venv-verifiers` (it pins openai<3 and
mcp==2.0.0 against rlexp's lock), which `make envs` creates."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rlexp.envs.process import ChildProcess
from rlexp.errors import ConfigError

WORKER = Path(__file__).resolve().parent / "verifiers_worker.py"
# The checkout (the directory that holds the rlexp package): `make envs` makes the venv there,
# so the default does not depend on the directory a run starts in.
CHECKOUT = Path(__file__).resolve().parents[2]
DEFAULT_PYTHON = str(CHECKOUT / ".venv-verifiers" / "bin" / "python")


def plain(value: Any) -> Any:
    """`value` as plain JSON types (a config's mappings and lists become dicts and lists)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(v) for v in value]
    return value


def check_python(python: str, option: str = "data.source.python") -> str:
    """The venv's Python (`option`'s value; a relative path is from the current directory), as
    an absolute path; a ConfigError naming `option` and how to set it if it is missing."""
    path = Path(python).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if not os.access(path, os.X_OK):
        raise ConfigError(f"{option}={python}: no such Python: verifiers environments run in their own "
                          f"venv; run `make envs` in {CHECKOUT} to create {DEFAULT_PYTHON} (the default), "
                          f"or set {option}=/path/to/venv/bin/python (a venv with verifiers==0.4.0)")
    return str(path)


def spec(env_id: str | None, env_args: Any = None, eval_args: Any = None, paths: Any = None,
         **more: Any) -> dict[str, Any]:
    """The worker's spec (its module docstring says what each key means); paths absolute."""
    if not env_id:
        raise ConfigError("no verifiers env_id: agent=verifiers runs the env that data=verifiers names "
                          "(data.source.env_id, the id of a verifiers taskset, e.g. vf_arith from "
                          "examples/environments/): add data=verifiers")
    return {"env_id": str(env_id), "env_args": plain(env_args or {}),
            "eval_args": plain(eval_args) if eval_args else None,
            "paths": [os.path.abspath(str(p)) for p in plain(paths or [])], **plain(more)}


def list_tasks(python: str, worker_spec: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    """The env's tasks (`{"info", "train", "eval"}`, the worker's --list), or a one-line
    ConfigError naming the env and why it cannot be loaded."""
    argv = [check_python(python), str(WORKER), "--list", "--spec", json.dumps(worker_spec)]
    name = f"verifiers env {worker_spec['env_id']!r}"
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{name}: listing its tasks took over {timeout_s:g}s") from None
    lines = done.stdout.decode(errors="replace").strip().splitlines()
    try:
        listing = json.loads(lines[-1]) if lines else None
    except ValueError:
        listing = None
    if isinstance(listing, dict) and "error" in listing:
        raise ConfigError(f"{name} cannot be loaded: {listing['error']}")
    if not isinstance(listing, dict) or "train" not in listing:
        tail = " | ".join(done.stderr.decode(errors="replace").strip().splitlines()[-5:])
        raise ConfigError(f"{name}: its worker exited with status {done.returncode} without listing the "
                          f"tasks{f'; stderr: {tail}' if tail else ''}")
    return listing


def worker(python: str, worker_spec: dict[str, Any], api_key: str | None = None,
           startup_timeout_s: float = 300.0, max_restarts: int = 3) -> ChildProcess:
    """A (not yet started) worker serving episodes of the env; `api_key`: the policy server's,
    which the worker sends (as RLEXP_POLICY_API_KEY in its environment, never on its command line)."""
    env = dict(os.environ)
    if api_key:
        env["RLEXP_POLICY_API_KEY"] = api_key
    argv = [check_python(python, "agent.python"), str(WORKER), "--spec", json.dumps(worker_spec)]
    return ChildProcess(f"verifiers env {worker_spec['env_id']!r}", argv, env=env,
                        startup_timeout_s=startup_timeout_s, max_restarts=max_restarts)
