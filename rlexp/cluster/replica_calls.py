"""Calling one rollout replica (a Ray actor, rlexp/cluster/replica.py) from the pool
(rlexp/cluster/pool.py): a call bounded in time (`answer`: ReplicaTimeout past it), which
failures mean the replica is lost (`is_lost`), waiting for Ray to restart a lost one
(`restarted`), and a failure as the one line the pool's logs name it by (`first_line`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class ReplicaTimeout(Exception):
    """A replica did not answer a call within `call_timeout_s` (not a TimeoutError: that one
    is a restart not done in time)."""


def is_lost(e: BaseException) -> bool:
    """Whether `e`, raised by a call to a replica, means the replica is lost (its actor died,
    or it did not answer in time), rather than that the call itself failed."""
    from ray.exceptions import RayActorError

    return isinstance(e, (RayActorError, ReplicaTimeout))


async def answer(ref: Any, timeout_s: float, what: str) -> Any:
    """`await ref`, a Ray call, for at most `timeout_s` (then cancelled: ReplicaTimeout)."""
    try:
        return await asyncio.wait_for(ref, timeout_s)
    except TimeoutError:
        import ray

        ray.cancel(ref)
        raise ReplicaTimeout(f"{what} did not answer within {timeout_s:g}s") from None


async def restarted(actor: Any, deadline: float) -> tuple[str, int, int]:
    """The replica `actor`'s ready() once Ray has restarted it (TimeoutError past `deadline`,
    a `time.monotonic()` time)."""
    from ray.exceptions import ActorUnavailableError

    while True:
        try:
            return await asyncio.wait_for(actor.ready.remote(), max(deadline - time.monotonic(), 0.0))
        except ActorUnavailableError:  # restarting
            await asyncio.sleep(0.5)


def first_line(e: BaseException) -> str:
    """`Type: message`, the message's first line (at most 200 characters)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__
