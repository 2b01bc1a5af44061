"""A prompt group's completions one request each: what an engine that cannot send them as
one request does for `RolloutEngine.generate_group`."""

from __future__ import annotations

import asyncio
from typing import Any

from rlexp.sample import Generation, SamplingConfig


async def generate_each(engine: Any, token_ids: list[int],
                        samplings: list[SamplingConfig]) -> list[Generation]:
    """`engine.generate(token_ids, s)` for each of `samplings`, concurrently, in order; the
    first that raises cancels the others."""
    tasks = [asyncio.ensure_future(engine.generate(token_ids, s)) for s in samplings]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
