"""What the teacher=openai tests share (test_teacher_openai.py, test_teacher_vllm_serve.py)."""

from __future__ import annotations

import asyncio
import socket
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
