"""RequestGroups: concurrent requests for one prompt with consecutive seeds go out as one
request with n; each caller gets the reply of its own seed (no engine: a recording send;
tests/test_engines.py checks the tokens against real vLLM)."""

import asyncio

import pytest

from rlexp.rollout.accounting import generated_tokens
from rlexp.rollout.vllm_groups import RequestGroups, consecutive
from rlexp.sample import SamplingConfig


class Recorder:
    def __init__(self, fail: bool = False):
        self.sent: list[tuple[int, int]] = []
        self.cancelled: list[int] = []
        self.release = asyncio.Event()
        self.fail = fail

    async def send(self, token_ids, sampling, n):
        self.sent.append((sampling.seed, n))
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(sampling.seed)
            raise
        if self.fail:
            raise RuntimeError("engine said no")
        return [([sampling.seed + i], [0.0], [], "stop", 0) for i in range(n)]


def _sampling(seed):
    return SamplingConfig(temperature=1.0, max_tokens=4, seed=seed)


def test_consecutive_seeds_are_one_request_and_each_caller_gets_its_own_seeds_reply():
    async def main():
        rec = Recorder()
        groups = RequestGroups(rec.send)
        seeds = [13, 10, 12, 11, 30, 20, 20]  # any order; 30 alone; 20 twice (each its own)
        calls = [asyncio.create_task(groups.request([1, 2], _sampling(s))) for s in seeds]
        other_prompt = asyncio.create_task(groups.request([1, 3], _sampling(14)))
        cooler = SamplingConfig(temperature=0.5, max_tokens=4, seed=14)
        other_settings = asyncio.create_task(groups.request([1, 2], cooler))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        rec.release.set()
        replies = await asyncio.gather(*calls, other_prompt, other_settings)
        return rec.sent, [r[0] for r in replies]

    sent, ids = asyncio.run(main())
    assert sorted(sent) == [(10, 4), (14, 1), (14, 1), (20, 1), (20, 1), (30, 1)]
    assert ids == [[13], [10], [12], [11], [30], [20], [20], [14], [14]]


def test_a_cancelled_caller_leaves_the_others_and_the_request_stops_when_all_are_cancelled():
    async def main():
        rec = Recorder()
        groups = RequestGroups(rec.send)
        calls = [asyncio.create_task(groups.request([1], _sampling(s))) for s in (5, 6, 7)]
        alone = [asyncio.create_task(groups.request([2], _sampling(s))) for s in (5, 6)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        calls[1].cancel()
        for c in alone:
            c.cancel()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        rec.release.set()
        kept = await asyncio.gather(calls[0], calls[2])
        return rec.cancelled, [r[0] for r in kept], calls[1].cancelled()

    cancelled, kept, one_cancelled = asyncio.run(main())
    assert cancelled == [5]  # the request of prompt [2], whose callers all left; not prompt [1]'s
    assert kept == [[5], [7]] and one_cancelled


def test_an_engine_error_reaches_every_caller_of_the_request():
    async def main():
        rec = Recorder(fail=True)
        groups = RequestGroups(rec.send)
        calls = [asyncio.create_task(groups.request([1], _sampling(s))) for s in (1, 2)]
        await asyncio.sleep(0)
        rec.release.set()
        return await asyncio.gather(*calls, return_exceptions=True)

    errors = asyncio.run(main())
    assert [str(e) for e in errors] == ["engine said no", "engine said no"]


def test_requests_counted_into_different_meters_are_never_one_request():
    """A group's tokens are counted into its own meter (the scheduler's per-group count)."""
    async def one(groups, meter, seed):
        generated_tokens.set(meter)
        return await groups.request([1], _sampling(seed))

    async def main():
        rec = Recorder()
        groups = RequestGroups(rec.send)
        calls = [asyncio.create_task(one(groups, [0], s)) for s in (1, 2)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        rec.release.set()
        await asyncio.gather(*calls)
        return rec.sent

    assert sorted(asyncio.run(main())) == [(1, 1), (2, 1)]


@pytest.mark.parametrize("seeds,runs", [([], []), ([3], [[3]]),
                                        ([1, 2, 4, 5, 5, 6], [[1, 2], [4, 5], [5, 6]])])
def test_consecutive_runs(seeds, runs):
    assert [[s for s, _ in r] for r in consecutive([(s, None) for s in seeds])] == runs
