"""cluster=ray: every wait of the RolloutPool on a replica is bounded (fake replicas, no Ray
cluster): a generation or a weight load past `call_timeout_s` sends the replica to a
restart and its requests to the others; a replica not back within `restart_timeout_s` is
given up in one log line naming it and its node, the pool serving on with the others; with
none left the run stops (EngineDead) naming each lost replica and its node. On a real local
Ray: a trainer rank that does not finish a call in time stops the run (TrainerDead), naming it
and its node, and so does a rank's error when a peer died, even if the error arrives first."""

import asyncio
import logging
import os
import signal
import threading
import time

import pytest

from rlexp.cluster.pool import RolloutPool
from rlexp.cluster.trainer_group import TrainerGroup
from rlexp.errors import EngineDead, TrainerDead
from tests.test_pool import SAMPLING, FakeReplica

# A hung fake replica hangs for ever; the bounds are seconds, so that a healthy one's answer
# (a few event-loop steps) beats them however loaded the machine.
CALL_TIMEOUT_S = 3.0


def _pool(call_timeout_s=60.0, restart_timeout_s=60.0):
    actors = [FakeReplica(i) for i in range(2)]
    pool = RolloutPool(actors, SAMPLING, 64, nodes=["node-a", "node-b"], call_timeout_s=call_timeout_s,
                       restart_timeout_s=restart_timeout_s)
    return pool, actors


def test_a_replica_not_back_in_time_is_given_up_and_with_none_left_the_run_stops(killed, caplog):
    async def main():
        pool, (a, b) = _pool(restart_timeout_s=0.3)
        a.dead = True  # Ray keeps it restarting: its node is gone and no other has room
        gens = await asyncio.gather(*(pool.generate([1], SAMPLING) for _ in range(3)))
        assert {g.token_ids[0] for g in gens} == {1}  # served by the other meanwhile
        await asyncio.wait(list(pool._recovering.values()))
        assert pool._healthy == [False, True] and not pool._recovering and killed == [(a, True)]
        assert (await pool.generate([1], SAMPLING)).token_ids[0] == 1  # the pool goes on with one
        b.dead = True
        with pytest.raises(EngineDead) as stopped:
            await pool.generate([1], SAMPLING)
        return str(stopped.value)

    with caplog.at_level(logging.WARNING, logger="rlexp.cluster.pool"):
        message = asyncio.run(main())
    lost = [r.getMessage() for r in caplog.records if "lost for good" in r.getMessage()]
    assert lost[0].startswith("rollout replica 0 lost for good (node node-a): not running again within 0.3s")
    assert lost[0].endswith("going on with 1 of 2 replica(s)") and len(lost) == 2
    assert "every rollout replica was lost (2): replica 0 on node node-a: not running again" in message
    assert "replica 1 on node node-b" in message and "cluster.restart_timeout_s" in message


def test_a_generation_past_the_call_timeout_restarts_its_replica_and_goes_to_another(killed, caplog):
    async def main():
        pool, (a, b) = _pool(call_timeout_s=CALL_TIMEOUT_S)
        a.gate.clear()  # replica 0 hangs in every generation
        gens = await asyncio.gather(*(pool.generate([1], SAMPLING) for _ in range(4)))
        assert {g.token_ids[0] for g in gens} == {1}
        assert killed == [(a, False)]  # Ray restarts it...
        a.gate.set()
        await asyncio.wait(list(pool._recovering.values()))
        assert pool._healthy == [True, True] and pool.restarts == [1, 0]  # ...and it serves again

    with caplog.at_level(logging.WARNING, logger="rlexp.cluster.pool"):
        asyncio.run(main())
    assert any(r.getMessage().startswith("rollout replica 0 lost during a generation (node node-a): "
                                         "ReplicaTimeout: rollout replica 0 did not answer within 3s")
               for r in caplog.records)


def test_a_weight_load_past_the_call_timeout_leaves_the_replica_to_its_restart(killed, caplog):
    async def main():
        pool, (a, b) = _pool(call_timeout_s=CALL_TIMEOUT_S)  # the catch-up's hang, not the restart, ends it
        hung = asyncio.Event()

        async def never(directory, version):
            await hung.wait()

        a._load_weights = never
        a.load_weights.fn = never
        await pool.load_weights("/dir", 3)  # returns: the other replica serves version 3
        assert b.version == pool.version == 3 and pool._healthy == [False, True]
        assert killed == [(a, False)]
        await asyncio.wait(list(pool._recovering.values()))  # back on "node", its catch-up hangs: given up
        assert pool._healthy == [False, True] and killed[-1] == (a, True)

    with caplog.at_level(logging.WARNING, logger="rlexp.cluster.pool"):
        asyncio.run(main())
    (gone,) = [r.getMessage() for r in caplog.records if "lost for good" in r.getMessage()]
    assert gone == ("rollout replica 0 lost for good (node node): ReplicaTimeout: rollout replica 0 did "
                    "not answer within 3s (cluster.call_timeout_s); going on with 1 of 2 replica(s)")


class _SlowRank:
    """A trainer rank whose fit takes a minute."""

    def fit(self, batch, version):
        time.sleep(60)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    ray.shutdown()


@pytest.mark.ray
def test_a_trainer_rank_past_the_call_timeout_stops_the_run(local_ray):
    rank = local_ray.remote(num_cpus=0)(_SlowRank).remote()
    group = TrainerGroup([rank], [0], ["node-a"], call_timeout_s=1.0)
    with pytest.raises(TrainerDead, match=r"trainer rank\(s\) \[0\] \(node\(s\) \['node-a'\]\) did not "
                                          r"finish fit within 1s \(cluster.call_timeout_s\)"):
        group.fit([], 1)
    group.shutdown()


class _Rank:
    """A trainer rank: `fit` returns, raises `error`, or blocks for good (`error="block"`, as in
    a collective whose peer never comes); `alive` (the driver's liveness probe) first SIGKILLs
    the process `kill_on_probe`, if given, so that a death reaches the driver after a peer's error."""

    def __init__(self, error=None, kill_on_probe=None):
        self.error, self.kill_on_probe = error, kill_on_probe

    def pid(self):
        return os.getpid()

    def fit(self, batch, version):
        if self.error == "block":
            threading.Event().wait()
        if self.error is not None:
            raise self.error
        return {}

    def alive(self):
        if self.kill_on_probe is not None:
            os.kill(self.kill_on_probe, signal.SIGKILL)
        return True


@pytest.mark.ray
def test_a_rank_error_that_reaches_the_driver_before_its_peers_death_is_a_trainer_death(local_ray):
    """Rank 1's collective fails (its peer is gone) and its error reaches the driver first; rank
    0's death is noticed only later (here: killed when the driver probes rank 1). The run stops
    with TrainerDead naming the dead rank and its node, rank 1's error kept as the context."""
    dead = local_ray.remote(num_cpus=0, max_restarts=0)(_Rank).remote("block")
    pid = local_ray.get(dead.pid.remote())
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:534] Read error [10.0.0.2]:4242: "
                         "Connection reset by peer")
    survivor = local_ray.remote(num_cpus=0)(_Rank).remote(reset, pid)
    group = TrainerGroup([dead, survivor], [pid, 0], ["node-a", "node-b"])
    stopped_by = (rf"trainer worker 0 \(pid {pid}, node node-a\) died \(ActorDiedError.*; "
                  r"trainer rank 1's fit failed after it: RuntimeError: \[gloo")
    with pytest.raises(TrainerDead, match=stopped_by) as stopped:
        group.fit([], 1)
    assert isinstance(stopped.value.__context__, RuntimeError)
    assert "Connection reset by peer" in str(stopped.value.__context__)
    group.shutdown()


@pytest.mark.ray
def test_a_rank_error_with_every_rank_alive_surfaces_as_it_is(local_ray):
    """A programming error in one rank's fit, the other rank alive: the error itself, not TrainerDead."""
    ranks = [local_ray.remote(num_cpus=0)(_Rank).remote(*spec) for spec in [(), (TypeError("bad batch"),)]]
    group = TrainerGroup(ranks, [0, 0], ["node-a", "node-b"])
    with pytest.raises(TypeError, match="bad batch") as raised:
        group.fit([], 1)
    assert not isinstance(raised.value, TrainerDead)
    group.shutdown()
