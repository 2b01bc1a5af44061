"""SyncScheduler: every trajectory of a step is generated concurrently, then training."""

from __future__ import annotations

import asyncio
import logging

from rlexp.sample import Sample, Status

log = logging.getLogger(__name__)


def collect(samples: list[Sample], results: list) -> list[list[Sample]]:
    """Agent results back into prompt groups. An agent returns one Sample, or several (a
    conversation that branched or was split at a prefix break); an exception marks the
    sample FAILED (kept, counted, never trained)."""
    groups: dict[int, list[Sample]] = {}
    for s, r in zip(samples, results):
        if isinstance(r, BaseException):
            log.warning("agent failed on sample %d: %r", s.uid, r)
            s.status = Status.FAILED
            s.metadata["error"] = repr(r)
            r = s
        for out in r if isinstance(r, list) else [r]:
            groups.setdefault(out.group_id, []).append(out)
    return list(groups.values())


class SyncScheduler:
    async def produce_batch(self, data, agent) -> list[Sample]:
        groups = data.sample_groups(data.prompts_per_step)
        flat = [s for g in groups for s in g]
        results = await asyncio.gather(*(agent.run(s) for s in flat), return_exceptions=True)
        groups = collect(flat, results)
        data.put(groups)
        return data.get_batch(len(groups))
