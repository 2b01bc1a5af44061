"""SyncScheduler: every trajectory of a step is generated concurrently, then training."""

from __future__ import annotations

import asyncio
import logging

from rlexp.sample import Sample, Status

log = logging.getLogger(__name__)


class SyncScheduler:
    async def produce_batch(self, data, agent) -> list[Sample]:
        groups = data.sample_groups(data.prompts_per_step)
        flat = [s for g in groups for s in g]
        results = await asyncio.gather(*(agent.run(s) for s in flat), return_exceptions=True)
        for s, r in zip(flat, results):
            if isinstance(r, BaseException):
                log.warning("agent failed on sample %d: %r", s.uid, r)
                s.status = Status.FAILED
                s.metadata["error"] = repr(r)
        data.put(groups)
        return data.get_batch(len(groups))
