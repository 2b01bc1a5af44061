"""A vLLM engine process that died, as rlexp's EngineDead (which stops the run with a resume
hint instead of failing samples one by one), wherever VLLMEngine calls into it: a request
(`engine_alive`) or a utility call such as collective_rpc, pause or reset_prefix_cache
(`watched`), which vLLM would otherwise leave pending forever."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any

from rlexp.errors import EngineDead

DEAD = ("the vLLM engine process died (killed, out of memory, or crashed; its log is above): "
        "every request would fail")
DEATH_POLL_S = 0.5  # how soon a call into a dead engine gives up


@contextlib.contextmanager
def engine_alive():
    """vLLM's EngineDeadError (its engine process died: killed, out of memory, ...) as
    rlexp's EngineDead, which stops the run instead of failing samples one by one; a
    request vLLM rejects (VLLMClientError: e.g. a JSON schema its grammar cannot take) as
    a ValueError, the engine's input error."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError as e:
        raise EngineDead(DEAD) from e
    except VLLMClientError as e:
        raise ValueError(str(e)) from e


async def watched(llm: Any, call: Awaitable[Any]) -> Any:
    """Await a call into `llm`'s engine process (collective_rpc, pause, reset_prefix_cache...).
    vLLM leaves such a call pending forever if the process dies while it is in flight (its
    pending utility futures are never failed), so this watches `llm.errored` meanwhile."""
    task = asyncio.ensure_future(call)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DEATH_POLL_S)
            if not task.done() and llm.errored:
                raise EngineDead(DEAD)
        with engine_alive():
            return task.result()
    finally:
        task.cancel()
