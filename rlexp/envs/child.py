"""The child's side of rlexp/envs/process.py: a script run by another Python (an environment
library's own venv) loads this file by its path (stdlib only: it imports nothing of rlexp, so
it works where rlexp is not installed) and calls `serve`:

    child = load_child()          # importlib, from this file's path
    child.serve(setup, handlers)  # setup() -> info (or raises); handlers: op -> async fn(params)

The protocol, one JSON object per line:
    child -> parent, once:  {"ready": true, "info": {...}}  or  {"ready": false, "error": "..."}
    parent -> child:        {"id": 7, "op": "episode", "params": {...}}   or  {"cancel": 7}
    child -> parent:        {"id": 7, "ok": true, "result": ...}
                            {"id": 7, "ok": false, "error": "...", "type": "ValueError"}
Requests run concurrently (one asyncio task each). Nothing else is written to the real
stdout: `serve` keeps it for the protocol and points file descriptor 1 at stderr, so print()
and libraries' output (and child processes that inherit fd 1) land in stderr, which the
parent keeps the tail of for its error messages.

The child exits when its stdin closes (the parent closed it, or died, even by SIGKILL): the
requests in flight are cancelled, given `grace_s` to clean up, and the process exits."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

Handler = Callable[[dict[str, Any]], Awaitable[Any]]
LINE_LIMIT = 64 << 20  # bytes in one request line


def one_line(e: BaseException) -> str:
    """`Type: message` on one line, then the causes it was raised from (`raise ... from`), each
    as `; caused by Type: message`: verifiers' "taskset 'x' not found" names the package the
    env failed to import only in its cause (`No module named 'sympy'`)."""
    parts: list[str] = []
    cause: BaseException | None = e
    while cause is not None and len(parts) < 4:
        parts.append(f"{type(cause).__name__}: {' '.join(str(cause).split())}")
        cause = cause.__cause__
    return "; caused by ".join(parts)


def take_stdout() -> TextIO:
    """The real stdout, for the protocol alone; fd 1 (and sys.stdout) now write to stderr."""
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def serve(setup: Callable[[], Awaitable[dict[str, Any]]], handlers: dict[str, Handler],
          teardown: Callable[[], Awaitable[None]] | None = None, grace_s: float = 10.0) -> int:
    """Run until stdin closes; the exit status (0, or 1 when `setup` failed)."""
    out = take_stdout()
    return asyncio.run(_main(out, setup, handlers, teardown, grace_s))


def _write(out: TextIO, message: dict[str, Any]) -> None:
    try:
        line = json.dumps(message)
    except (TypeError, ValueError) as e:  # a result that is not JSON: the request fails, not the child
        line = json.dumps({"id": message.get("id"), "ok": False, "type": "TypeError",
                           "error": f"the result is not JSON-serialisable: {one_line(e)}"})
    try:
        out.write(line + "\n")
        out.flush()
    except (BrokenPipeError, ValueError):  # the parent is gone: stdin closes next
        pass


async def _stdin_reader() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=LINE_LIMIT)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


async def _main(out: TextIO, setup: Callable[[], Awaitable[dict[str, Any]]], handlers: dict[str, Handler],
                teardown: Callable[[], Awaitable[None]] | None, grace_s: float) -> int:
    try:
        info = await setup()
    except BaseException as e:  # noqa: BLE001 - reported to the parent as the start-up failure
        traceback.print_exc()
        _write(out, {"ready": False, "error": one_line(e)})
        return 1
    reader = await _stdin_reader()
    _write(out, {"ready": True, "info": info})
    tasks: dict[Any, asyncio.Task] = {}

    async def run(rid: Any, op: str, params: dict[str, Any]) -> None:
        try:
            if op not in handlers:
                raise ValueError(f"unknown op {op!r} (this child serves {sorted(handlers)})")
            result = await handlers[op](params)
        except asyncio.CancelledError:
            _write(out, {"id": rid, "ok": False, "type": "CancelledError", "error": "cancelled"})
            raise
        except Exception as e:  # noqa: BLE001 - every failure is the request's answer
            traceback.print_exc()
            _write(out, {"id": rid, "ok": False, "type": type(e).__name__, "error": one_line(e)})
        else:
            _write(out, {"id": rid, "ok": True, "result": result})
        finally:
            tasks.pop(rid, None)

    while True:
        try:
            line = await reader.readline()
        except ValueError as e:  # a line over LINE_LIMIT: the stream cannot be resynchronised
            print(f"child: {one_line(e)}; exiting", file=sys.stderr)
            break
        if not line:
            break  # stdin closed: the parent is done with us, or gone
        try:
            message = json.loads(line)
        except ValueError:
            print(f"child: not a JSON line: {line[:200]!r}", file=sys.stderr)
            continue
        if "cancel" in message:
            task = tasks.get(message["cancel"])
            if task is not None:
                task.cancel()
            continue
        rid = message.get("id")
        tasks[rid] = asyncio.create_task(run(rid, str(message.get("op")), message.get("params") or {}))
    pending = list(tasks.values())
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=grace_s)
    if teardown is not None:
        try:
            await asyncio.wait_for(teardown(), grace_s)
        except BaseException:  # noqa: BLE001 - exiting anyway
            traceback.print_exc()
    return 0
