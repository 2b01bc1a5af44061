"""cluster=ray: a replica lost with its node, when no live node has room for its bundle, says
so in its loss line (Ray's available resources per node; here given as dicts, the replicas
fakes) instead of waiting silently for a restart that needs a new node."""

import asyncio
import logging

from rlexp.cluster.pool import RolloutPool
from rlexp.cluster.replica import room_report
from tests.test_pool import SAMPLING, FakeReplica

BUNDLE = {"CPU": 2.0}
ALIVE = "aaaa1111" + "0" * 48  # Ray's node ids: 56 hex digits; the pool keeps their first 8


def test_room_is_reported_only_when_the_node_is_gone_and_no_live_node_has_the_bundle_free():
    assert room_report(BUNDLE, "aaaa1111", {ALIVE: {"CPU": 0.0}}) is None  # restarts in its own bundle
    assert room_report(BUNDLE, "dead0000", {ALIVE: {"CPU": 2.0}}) is None  # placed again there
    assert room_report(BUNDLE, "dead0000", {ALIVE: {"CPU": 1.5}, "bbbb2222" + "0" * 48: {"GPU": 1.0}}) == (
        "its node is gone and no live node has room for its bundle (2 CPU; free: node aaaa1111: 1.5 CPU; "
        "node bbbb2222: 0 CPU)")
    assert room_report(BUNDLE, "dead0000", {}) == ("its node is gone and no live node has room for its "
                                                   "bundle (2 CPU; free: no live node)")


def test_a_replica_lost_with_no_room_anywhere_says_so_in_its_loss_line(caplog):
    free = {ALIVE: {"CPU": 1.0}}

    async def main():
        actors = [FakeReplica(0), FakeReplica(1)]
        pool = RolloutPool(actors, SAMPLING, 64, nodes=["dead0000", "aaaa1111"], restart_timeout_s=300.0,
                           room=lambda node: room_report(BUNDLE, node, free))
        actors[0].dead = True  # its node is gone: Ray keeps it restarting
        gens = await asyncio.gather(*(pool.generate([1], SAMPLING) for _ in range(2)))
        assert {g.token_ids[0] for g in gens} == {1}  # served by the other meanwhile
        assert pool._healthy == [False, True] and list(pool._recovering) == [0]
        for task in pool._recovering.values():
            task.cancel()

    with caplog.at_level(logging.WARNING, logger="rlexp.cluster.pool"):
        asyncio.run(main())
    (lost,) = [r.getMessage() for r in caplog.records if " lost during " in r.getMessage()]
    assert lost.startswith("rollout replica 0 lost during a generation (node dead0000): ActorDiedError")
    assert lost.endswith("; 1 replica(s) serving, its node is gone and no live node has room for its bundle "
                         "(2 CPU; free: node aaaa1111: 1 CPU): it comes back only if a node with room joins "
                         "within 300s (cluster.restart_timeout_s) or is given up")
