"""cluster=ray: the RolloutPool's routing, accounting, fan-out and fault handling over fake
replicas (no Ray cluster: `FakeReplica` answers as an EngineReplica handle does): requests go
to the least loaded replica and a conversation stays on one; tokens are counted from the
generations that come back; a lost replica's requests finish elsewhere and it comes back
with the current weights; with every replica gone for good the run stops. On a real Ray
cluster: tests/test_cluster.py."""

import asyncio
import os

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from rlexp.cluster.pool import RolloutPool
from rlexp.errors import EngineDead
from rlexp.rollout.accounting import conversation, generated_tokens
from rlexp.sample import Generation, SamplingConfig

SAMPLING = SamplingConfig(temperature=1.0, top_p=1.0, max_tokens=4, seed=0)


class _Remote:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class FakeReplica:
    """An EngineReplica handle: every method answers `.remote(...)` with an awaitable."""

    def __init__(self, index: int):
        self.index, self.version, self.loads, self.paused = index, 0, [], None
        self.again = 0  # tokens it says it prefilled again, with each reply
        self.dead = False  # True: calls raise as a dead Ray actor's do
        self.restarting = True  # while dead: Ray brings it back
        self.gate = asyncio.Event()
        self.gate.set()
        for name in ("generate_counted", "ready", "pause", "resume", "load_weights", "sleep", "wake_up"):
            setattr(self, name, _Remote(getattr(self, "_" + name)))

    def _check(self):
        if self.dead:
            raise ActorDiedError()

    async def _generate_counted(self, ids, sampling, images=None):
        self._check()
        await self.gate.wait()
        self._check()
        return Generation([self.index] * 3, [-0.5] * 3, "length", [self.version] * 3), self.again

    async def _ready(self):
        if self.dead and self.restarting:
            raise ActorUnavailableError("restarting", None)
        self._check()
        return "node", os.getpid(), self.version

    async def _pause(self, mode):
        self._check()
        self.paused = mode

    async def _resume(self):
        self._check()
        self.paused = None

    async def _load_weights(self, directory, version):
        self._check()
        self.loads.append(version)
        self.version = version

    async def _sleep(self):
        pass

    async def _wake_up(self):
        pass


class _Conversation:
    """Any object that lives as long as the conversation (a sample, a chat session)."""


def _pool(n=2):
    actors = [FakeReplica(i) for i in range(n)]
    return RolloutPool(actors, SAMPLING, 64), actors


def test_requests_go_to_the_least_loaded_replica_and_a_conversation_stays_on_one():
    async def main():
        pool, (a, b) = _pool()
        a.gate.clear()  # replica 0 holds its requests
        b.gate.clear()
        first = [asyncio.create_task(pool.generate([1], SAMPLING)) for _ in range(4)]
        await asyncio.sleep(0)
        assert pool.in_flight == [2, 2]  # spread, not all on the first replica

        async def session():  # one conversation: every turn on the replica of its first turn
            conversation.set(_Conversation())
            return [(await pool.generate([1], SAMPLING)).token_ids[0] for _ in range(3)]

        a.gate.set()
        b.gate.set()
        await asyncio.gather(*first)
        turns = await asyncio.gather(*(session() for _ in range(6)))
        assert all(len(set(t)) == 1 for t in turns)  # each session on one replica...
        assert {t[0] for t in turns} == {0, 1}  # ...and sessions on both

    asyncio.run(main())


def test_tokens_are_counted_from_the_generations_that_come_back():
    async def main():
        pool, (a, b) = _pool()
        meter = [0]
        generated_tokens.set(meter)
        a.again, b.again = 1, 10  # each reply's tokens prefilled again on its replica
        await asyncio.gather(*(pool.generate([1], SAMPLING) for _ in range(5)))
        assert meter == [15] and pool.busy.tokens == 15
        m = pool.pop_replica_metrics()
        assert m["replica/0/tokens"] + m["replica/1/tokens"] == 15
        assert m["replica/0/requests"] + m["replica/1/requests"] == 5
        # the step's rollout/prefilled_again_tokens: the sum over the replicas
        assert pool.busy.prefilled_again == m["replica/0/requests"] + 10 * m["replica/1/requests"]
        assert [r.prefilled_again for r in pool.replica_busy] == [m["replica/0/requests"],
                                                                   10 * m["replica/1/requests"]]

    asyncio.run(main())


def test_a_lost_replica_is_retried_elsewhere_then_restarted_with_the_current_weights():
    async def main():
        pool, (a, b) = _pool()
        await pool.load_weights("/dir", 4)
        assert a.version == b.version == pool.version == 4
        a.dead = True  # Ray is restarting it
        gens = await asyncio.gather(*(pool.generate([1], SAMPLING) for _ in range(4)))
        assert {g.token_ids[0] for g in gens} == {1}  # all served by the live replica
        assert pool._healthy == [False, True]
        await pool.pause("abort")  # fan-outs skip it meanwhile
        a.version, a.dead = 0, False  # back, with the model path's weights
        await asyncio.wait(list(pool._recovering.values()))
        assert pool._healthy == [True, True] and pool.restarts == [1, 0]
        assert a.version == 4 and a.loads == [4, 4]  # caught up with the pool
        assert a.paused == "abort"  # and joined the pause in effect
        await pool.resume()
        assert a.paused is None and b.paused is None

    asyncio.run(main())


def test_with_every_replica_gone_for_good_the_run_stops(killed):
    async def main():
        pool, actors = _pool()
        for r in actors:
            r.dead, r.restarting = True, False  # and never comes back: its restarts are exhausted
        with pytest.raises(EngineDead, match="every rollout replica was lost"):
            await pool.generate([1], SAMPLING)

    asyncio.run(main())
