"""RolloutPool: `rollout.replicas` engines, each in its own Ray actor, behind the one
RolloutEngine Protocol, so schedulers, agents and the chat server use it unchanged.

- Routing: a request goes to the replica with the fewest requests in flight; every request
  of one conversation (`accounting.conversation`) goes to the replica that served its first.
- Weights: pause / resume / weight updates fan out to every replica; generation resumes
  only once all of them serve the new version.
- Accounting is counted here, from the generations that come back (the replicas' own
  counters live in other processes). The tokens prefilled again (a replica's engine re-sends a
  request an abort pause cut short) are counted by each replica's engine; each reply brings
  its replica's count since its last one, summed here into `busy.prefilled_again` (and per
  replica into `replica_busy`): rlexp/step.py's `rollout/prefilled_again_tokens`.
- Faults: a replica whose actor dies, or that does not answer a call within
  `call_timeout_s` (one call to one replica: rlexp/cluster/replica_calls.py), is taken out
  of routing; its requests are retried on the others (per-request seeds give the same
  tokens). Ray restarts the actor (its engine starts from the model path, on another node
  if its own is gone); the pool then loads the current weights and version into it before
  routing to it again. A replica not back within `restart_timeout_s` (no node has room for
  it) is lost for good: one log line names it and its node, and the pool goes on with the
  others. Where, at the loss, its node is gone and no live node has room for its bundle
  (`room`: Ray's available resources), the loss line says so: it comes back only if a node
  with room joins in time. With no replica left the run stops (EngineDead: resume hint).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from rlexp.cluster.pool_weights import PoolWeights
from rlexp.cluster.replica_calls import ReplicaTimeout, answer, first_line, is_lost, restarted
from rlexp.constraints import UpdateMode
from rlexp.errors import EngineDead
from rlexp.protocols import RolloutEngine
from rlexp.rollout.accounting import BusyMeter, conversation, count_generated
from rlexp.sample import Generation, SamplingConfig

log = logging.getLogger(__name__)


class RolloutPool(PoolWeights, RolloutEngine):
    """`actors`: EngineReplica handles (already placed); `nodes`: the node id of each.
    `sampling` / `max_model_len`: the engines' settings (the same for all).
    `call_timeout_s`: the longest any one call on a replica may take (a generation, a weight
    load); `restart_timeout_s`: how long a lost replica may take to come back. `room(node)`:
    why a replica lost with `node` cannot come back now (replica.no_room), or None. A reply
    comes back from its replica whole: `generate_streaming` is the Protocol's default."""

    update_modes: tuple[str, ...] = ("keep", "abort", "wait")  # its replicas' (VLLMEngine's)
    serves_adapters = True  # its replicas' (rollout.max_lora_rank > 0), through the object store

    def __init__(self, actors: list[Any], sampling: SamplingConfig, max_model_len: int,
                 sleeps: bool = False, nodes: list[str] | None = None, call_timeout_s: float = 600.0,
                 restart_timeout_s: float = 300.0, room: Callable[[str], str | None] | None = None):
        self.actors = actors
        self._room = room
        self.nodes = list(nodes) if nodes is not None else ["unknown"] * len(actors)
        self.call_timeout_s, self.restart_timeout_s = call_timeout_s, restart_timeout_s
        self._gone: dict[int, str] = {}  # replica -> why it was lost for good
        self.sampling = sampling
        self.max_model_len = max_model_len
        self.version = 0
        self.busy = BusyMeter()  # busy while any replica has a request in flight
        self.replica_busy = [BusyMeter() for _ in actors]
        self.in_flight = [0] * len(actors)
        self.restarts = [0] * len(actors)
        self._peak = [0] * len(actors)  # most requests in flight since the last report
        self._requests = [0] * len(actors)
        self._reported = [(0.0, 0) for _ in actors]  # (busy_s, tokens) at the last report
        self._healthy = [True] * len(actors)
        self._recovering: dict[int, asyncio.Task] = {}
        self._sticky: dict[int, int] = {}  # id(conversation) -> its replica
        self._running = asyncio.Event()
        self._running.set()
        self._paused_with: UpdateMode | None = None  # the mode of the pause now in effect
        self._sleeping = False
        self._update = asyncio.Lock()  # one weight update (or a replica's catch-up) at a time
        # How the current weights were loaded: a restarted replica runs it too
        self._reload: Callable[[Any], Awaitable[None]] | None = None
        self.sleeps = sleeps
        self._pulled_bytes, self._pulled_nodes = 0, 0  # object-store syncs since the last report

    # ---- routing ---------------------------------------------------------------------
    def _pick(self, key: Any, excluded: set[int]) -> int | None:
        i = self._sticky.get(id(key)) if key is not None else None
        if i is not None and self._healthy[i] and i not in excluded:
            return i
        candidates = [i for i, ok in enumerate(self._healthy) if ok and i not in excluded]
        if not candidates:
            return None
        i = min(candidates, key=lambda j: (self.in_flight[j], j))
        if key is not None:
            if id(key) not in self._sticky:  # forgotten with the conversation
                weakref.finalize(key, self._sticky.pop, id(key), None)
            self._sticky[id(key)] = i
        return i

    async def generate(self, token_ids: list[int], sampling: SamplingConfig,
                       images: list | None = None) -> Generation:
        key = conversation.get()
        failed: set[int] = set()
        while True:
            await self._running.wait()
            i = self._pick(key, failed)
            if i is None:
                if self._recovering:  # every replica down, some restarting: wait for one
                    await asyncio.wait(list(self._recovering.values()), return_when=asyncio.FIRST_COMPLETED)
                    failed.clear()
                    continue
                raise EngineDead(self._none_left())
            ref = self.actors[i].generate_counted.remote(token_ids, sampling, images)
            self._enter(i)
            try:
                gen, again = await answer(ref, self.call_timeout_s, f"rollout replica {i}")
            except asyncio.CancelledError:
                import ray

                ray.cancel(ref)
                raise
            except Exception as e:
                if not (isinstance(e, EngineDead) or is_lost(e)):
                    raise
                failed.add(i)
                self._replica_lost(i, "a generation", e)
                continue
            finally:
                self._exit(i)
            n = len(gen.token_ids)
            count_generated(n)
            self.busy.tokens += n
            self.replica_busy[i].tokens += n
            self.busy.prefilled_again += again  # the sum over the replicas
            self.replica_busy[i].prefilled_again += again
            return gen

    def _enter(self, i: int) -> None:
        self.in_flight[i] += 1
        self._requests[i] += 1
        self._peak[i] = max(self._peak[i], self.in_flight[i])
        self.busy.enter()
        self.replica_busy[i].enter()

    def _exit(self, i: int) -> None:
        self.in_flight[i] -= 1
        self.busy.exit()
        self.replica_busy[i].exit()

    # ---- faults ----------------------------------------------------------------------
    def _replica_lost(self, i: int, during: str, error: BaseException) -> None:
        """Replica `i` failed `during` a call: out of routing, restarted (a replica whose
        vLLM process died, or that hung, is restarted by killing its actor)."""
        if not self._healthy[i]:
            return
        self._healthy[i] = False
        why = self._room(self.nodes[i]) if self._room is not None else None
        back = (f"{why}: it comes back only if a node with room joins within {self.restart_timeout_s:g}s"
                if why else f"it comes back within {self.restart_timeout_s:g}s")
        log.warning("rollout replica %d lost during %s (node %s): %s; %d replica(s) serving, %s "
                    "(cluster.restart_timeout_s) or is given up", i, during, self.nodes[i],
                    first_line(error), sum(self._healthy), back)
        if isinstance(error, (EngineDead, ReplicaTimeout)):
            import ray

            ray.kill(self.actors[i], no_restart=False)
        self._recovering[i] = asyncio.create_task(self._recover(i))

    async def _recover(self, i: int) -> None:
        """Wait (at most restart_timeout_s) for Ray to restart the actor, bring it to the
        pool's weights, version and state, then route to it again; else give it up."""
        from ray.exceptions import ActorDiedError

        t0 = time.monotonic()
        try:
            node, _, _ = await restarted(self.actors[i], t0 + self.restart_timeout_s)
            self.nodes[i] = node[:8]  # as Ray's CLI shows it
            async with self._update:  # routed again before the next update starts
                await self._catch_up(i)
                self.restarts[i] += 1
                self._healthy[i] = True
                _, _, version = await answer(self.actors[i].ready.remote(), self.call_timeout_s,
                                             f"rollout replica {i}")
            # A transport that keeps no copy of the weights (vLLM's NCCL / IPC) leaves it at
            # version 0 until the next sync; its tokens say so.
            log.warning("rollout replica %d restarted by Ray on node %s; serves policy version %d (%.1fs)",
                        i, self.nodes[i], version, time.monotonic() - t0)
        except (ActorDiedError, ReplicaTimeout) as e:
            self._give_up(i, first_line(e))
        except TimeoutError:
            self._give_up(i, f"not running again within {self.restart_timeout_s:g}s of its loss "
                             "(cluster.restart_timeout_s): no node has room for it")
        finally:
            self._recovering.pop(i, None)

    async def _catch_up(self, i: int) -> None:
        """The current weights, sleep and pause state into restarted replica `i`."""
        actor, bound = self.actors[i], self.call_timeout_s
        if self._reload is not None:
            await self._bounded(self._reload(actor), i)
        if self._sleeping:
            await answer(actor.sleep.remote(), bound, f"rollout replica {i}")
        if self._paused_with is not None:
            await answer(actor.pause.remote(self._paused_with), bound, f"rollout replica {i}")

    def _give_up(self, i: int, why: str) -> None:
        import ray

        self._gone[i] = f"replica {i} on node {self.nodes[i]}: {why}"
        with contextlib.suppress(Exception):
            ray.kill(self.actors[i], no_restart=True)
        log.error("rollout replica %d lost for good (node %s): %s; going on with %d of %d replica(s)",
                  i, self.nodes[i], why, sum(self._healthy), len(self.actors))

    def _none_left(self) -> str:
        gone = "; ".join(self._gone.values()) or "Ray restarts exhausted, see cluster.max_restarts"
        return f"every rollout replica was lost ({len(self.actors)}): {gone}"

    async def _fan_out(self, call: Callable[[Any], Any]) -> None:
        """`call(actor)` on every routed replica, together; a replica lost on the way is left
        to recovery (which brings it to the same state)."""
        live = [i for i, ok in enumerate(self._healthy) if ok]
        results = await asyncio.gather(*(self._bounded(call(self.actors[i]), i) for i in live),
                                       return_exceptions=True)
        for i, r in zip(live, results):
            if isinstance(r, BaseException):
                if not is_lost(r):
                    raise r
                self._replica_lost(i, "a call to every replica (pause, resume or a weight sync)", r)
        if not any(self._healthy) and not self._recovering:
            raise EngineDead(self._none_left())

    async def _bounded(self, call: Awaitable[Any], i: int) -> Any:
        try:
            return await asyncio.wait_for(call, self.call_timeout_s)
        except TimeoutError:
            raise ReplicaTimeout(f"rollout replica {i} did not answer within {self.call_timeout_s:g}s "
                                 "(cluster.call_timeout_s)") from None

    # ---- the Protocol's fan-outs -------------------------------------------------------
    async def pause(self, mode: UpdateMode) -> None:
        self._running.clear()
        self._paused_with = mode
        await self._fan_out(lambda a: a.pause.remote(mode))

    async def resume(self) -> None:
        self._paused_with = None
        await self._fan_out(lambda a: a.resume.remote())
        self._running.set()

    async def sleep(self) -> None:
        if self.sleeps:
            self._sleeping = True
            await self._fan_out(lambda a: a.sleep.remote())

    async def wake_up(self) -> None:
        if self.sleeps:
            self._sleeping = False
            await self._fan_out(lambda a: a.wake_up.remote())

    # ---- reporting -------------------------------------------------------------------
    def pop_replica_metrics(self) -> dict[str, float]:
        """Per replica, since the last call: generation speed while busy, requests, the most
        in flight at once; restarts so far. With object-store syncs since the last call: the
        bytes other nodes pulled, and how many nodes pulled them at the last one."""
        out: dict[str, float] = {}
        for i, meter in enumerate(self.replica_busy):
            busy0, tokens0 = self._reported[i]
            busy, tokens = meter.busy_s - busy0, meter.tokens - tokens0
            self._reported[i] = (meter.busy_s, meter.tokens)
            prefix = f"replica/{i}/"
            out |= {prefix + "tokens": float(tokens), prefix + "requests": float(self._requests[i]),
                    prefix + "in_flight_max": float(self._peak[i]),
                    prefix + "restarts": float(self.restarts[i])}
            if busy > 0.01:
                out[prefix + "tokens_per_s"] = tokens / busy
            self._requests[i] = 0
            self._peak[i] = self.in_flight[i]
        if self._pulled_bytes:
            out |= {"weights/object_store_bytes_pulled": float(self._pulled_bytes),
                    "weights/object_store_nodes_pulled": float(self._pulled_nodes)}
            self._pulled_bytes = 0
        return out

    def shutdown(self) -> None:
        import ray

        for task in self._recovering.values():
            task.cancel()
        refs = [a.shutdown.remote() for a, ok in zip(self.actors, self._healthy) if ok]
        try:
            ray.get(refs, timeout=60)
        except Exception as e:  # a dead or stuck replica: killed below all the same
            log.warning("rollout replica shutdown: %s", e)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
