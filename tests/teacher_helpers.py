"""What the teacher=openai tests share (test_teacher_openai.py, test_teacher_vllm_serve.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

from rlexp.teachers.openai import OpenAITeacher


def free_port() -> int:
    """A loopback port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def score(t: OpenAITeacher, *sequences: list[int]) -> list[Any]:
    """`t`'s scores of the sequences, requested at once; the teacher shut down after."""
    async def run() -> list[Any]:
        try:
            return list(await asyncio.gather(*(t.score(s) for s in sequences)))
        finally:
            t.shutdown()

    return asyncio.run(run())


@contextlib.contextmanager
def serving(handler) -> Iterator[str]:
    """`handler` (an http.server request handler class) on a loopback port, in a thread: its
    root url, until the block ends."""
    http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    http.daemon_threads = True
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}"
    finally:
        http.shutdown()
        http.server_close()
