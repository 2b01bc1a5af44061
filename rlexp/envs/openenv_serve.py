"""Serve one OpenEnv environment with OpenEnv's own server (`create_app`: HTTP, `/ws`
sessions, `/schema`, `/health`) under uvicorn. Run by rlexp (rlexp/envs/openenv_server.py) as a
script in OpenEnv's venv, never imported by rlexp itself:

    .venv-openenv/bin/python rlexp/envs/openenv_serve.py package.module:attr --max-sessions 64

`attr`: an `Environment` subclass (its Action and Observation types read from its generic
bases, `class MyEnv(Environment[MyAction, MyObservation, State])`; served with
`max_concurrent_envs=--max-sessions`), or a FastAPI app already made with `create_app`
(served as it is, with its own session limit).

Its first stdout line is JSON: `{"port": N}` once the socket is bound, or `{"error": "..."}`
(one line) if the environment cannot be served; everything after goes to stderr. It exits
when its stdin closes, so it never outlives rlexp (killed or not)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import sys
import threading
import typing

# This script's own directory holds rlexp's openenv.py, which would hide the openenv package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


def _exit_when_stdin_closes() -> None:
    try:
        while sys.stdin.buffer.read(65536):
            pass
    finally:
        os._exit(0)


def load(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"environment must look like 'package.module:Class', got {spec!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def action_and_observation(env_cls) -> tuple[type, type]:
    """The Action and Observation types of `Environment[ActT, ObsT, StateT]` among the bases."""
    from openenv.core.env_server.types import Action, Observation

    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = [a for a in typing.get_args(base) if isinstance(a, type)]
            action = next((a for a in args if issubclass(a, Action)), None)
            observation = next((a for a in args if issubclass(a, Observation)), None)
            if action is not None and observation is not None:
                return action, observation
    raise TypeError(f"{env_cls.__name__} does not name its Action and Observation types: declare it as "
                    f"class {env_cls.__name__}(Environment[MyAction, MyObservation, State])")


def build_app(spec: str, max_sessions: int):
    # OpenEnv's package imports its Gradio web UI when it can (seconds), which a training
    # server never serves: it is kept out while openenv loads (an environment may import it)
    sys.modules.setdefault("gradio", None)  # type: ignore[arg-type]
    try:
        from openenv.core.env_server import Environment, create_app
    finally:
        if sys.modules.get("gradio", 0) is None:
            del sys.modules["gradio"]
    target = load(spec)
    if hasattr(target, "router"):  # a FastAPI app made with create_app
        return target
    if not (isinstance(target, type) and issubclass(target, Environment)):
        raise TypeError(f"{spec} is neither an openenv Environment subclass nor a FastAPI app")
    action, observation = action_and_observation(target)
    return create_app(target, action, observation, env_name=target.__name__, max_concurrent_envs=max_sessions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("environment")
    parser.add_argument("--max-sessions", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    threading.Thread(target=_exit_when_stdin_closes, daemon=True).start()
    # stdout is rlexp's pipe, for the one line below; whatever else writes there (the
    # environment's prints, from its import on) goes to stderr
    report = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        import uvicorn

        app = build_app(args.environment, args.max_sessions)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, 0))
    except BaseException as e:  # reported to rlexp as one line, whatever it is
        first = (str(e).strip().splitlines() or [""])[0]
        print(json.dumps({"error": f"{type(e).__name__}: {first}"}), file=report, flush=True)
        sys.exit(1)
    print(json.dumps({"port": sock.getsockname()[1]}), file=report, flush=True)
    report.close()
    config = uvicorn.Config(app, log_level="warning", access_log=False, ws_max_size=16 << 20)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
