"""TrainerGroup: `trainer.workers` ranks of one torch.distributed group, each a Ray actor
holding a TrainController (FSDP2-sharded: rlexp/trainer/distributed.py), behind the Trainer
Protocol, so the loop drives it like the one-process trainer.

- fit: the batch goes into Ray's object store once; every rank gets all of it and trains
  its token-balanced share. The metrics come back reduced over ranks, plus each rank's
  `memory/rank_<i>/peak_mb`.
- weights: streamed to the driver in buckets of about `BUCKET_BYTES`. Each rank gathers
  each full tensor (a collective) and rank 0 sends it, so the driver holds one bucket at a time.
- save / load: every rank takes part; rank 0 writes whole tensors, which any number of
  workers can load.
- faults: a rank that dies ends the group (the others would wait in a collective forever).
  The run stops with TrainerDead and the resume hint; resuming may use another worker count.
  A rank whose call fails while a peer is dead (its collective lost the peer) stops it the
  same way, whichever of the two errors reaches the driver first.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlexp.errors import TrainerDead
from rlexp.sample import Sample

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 << 20
DEATH_GRACE_S = 30.0  # Ray reports a killed rank's death within seconds, even on a busy host


def _summary(error: BaseException) -> str:
    """`Type: first line` of an error; a rank's own error for Ray's RayTaskError."""
    cause = getattr(error, "cause", None)
    error = cause if isinstance(cause, BaseException) else error
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class TrainerWorker:
    """Runs inside a Ray actor: rank `rank` of the group, its TrainController built from `spec`
    (the trainer group's config, with `_target_`)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.trainer: Any = None
        self._stream: Iterator[tuple[str, torch.Tensor]] | None = None

    def endpoint(self) -> tuple[str, int, int]:
        """(address, a free port, pid) of this worker: rank 0's is the group's rendezvous."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        import ray

        return ray.util.get_node_ip_address(), port, os.getpid()

    def setup(self, address: str, port: int, spec: dict[str, Any], model_path: str) -> None:
        import torch.distributed as dist
        from hydra.utils import instantiate

        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray makes this actor's GPU the only visible one
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world)
        self.trainer = instantiate(spec, model_path=model_path)

    def fit(self, batch: list[Sample], version: int) -> dict[str, float]:
        return self.trainer.fit(batch, version)

    def next_weights(self, max_bytes: int) -> tuple[list[tuple[str, torch.Tensor]], bool]:
        """The next bucket of full tensors (rank 0; the others gather and send nothing) and
        whether the stream is done."""
        if self._stream is None:
            self._stream = self.trainer.weights()
        bucket, size = [], 0
        for name, t in self._stream:
            if self.rank == 0:
                bucket.append((name, t.detach().to("cpu", copy=True)))
            size += t.numel() * t.element_size()
            if size >= max_bytes:
                return bucket, False
        self._stream = None
        return bucket, True

    def save(self, directory: str) -> None:
        self.trainer.save(Path(directory))

    def load(self, directory: str) -> None:
        self.trainer.load(Path(directory))

    def fits_done(self) -> int:
        return self.trainer.fits_done

    def alive(self) -> bool:
        """The driver's probe: answers while this rank's process lives."""
        return True


class TrainerGroup:
    """The driver's handle on the ranks (`actors`, rank order), built by RayCluster.trainer."""

    def __init__(self, actors: list[Any], pids: list[int], nodes: list[str] | None = None,
                 call_timeout_s: float = 600.0, death_grace_s: float = DEATH_GRACE_S):
        """`nodes`: each rank's node id; `call_timeout_s`: the longest one call (a fit, a
        weight bucket, a checkpoint) may take on every rank; `death_grace_s`: how long a rank's
        error waits for news of a peer's death (`_raise_if_a_peer_died`)."""
        self.actors, self.pids, self.call_timeout_s = actors, pids, call_timeout_s
        self.nodes = nodes if nodes is not None else ["unknown"] * len(actors)
        self.death_grace_s = death_grace_s

    def _all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every rank and wait for all, at most call_timeout_s; a dead rank
        (or its node lost) raises TrainerDead at once (the others would block in a
        collective waiting for it), and so does a rank's error when a peer died."""
        import ray

        refs = [getattr(a, method).remote(*args) for a in self.actors]
        pending, results = list(refs), {}
        deadline = time.monotonic() + self.call_timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not done:
                late = [refs.index(r) for r in pending]
                raise TrainerDead(f"trainer rank(s) {late} (node(s) {[self.nodes[r] for r in late]}) did not "
                                  f"finish {method} within {self.call_timeout_s:g}s (cluster.call_timeout_s)")
            rank = refs.index(done[0])
            try:
                results[rank] = ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                raise TrainerDead(self._died(rank, e)) from e
            except Exception as e:
                self._raise_if_a_peer_died(refs, pending, f"trainer rank {rank}'s {method} failed after it: "
                                                          f"{_summary(e)}")
                raise
        return [results[r] for r in range(len(refs))]

    def _died(self, rank: int, error: BaseException) -> str:
        return (f"trainer worker {rank} (pid {self.pids[rank]}, node {self.nodes[rank]}) died "
                f"({type(error).__name__}; Ray's log above says more)")

    def _raise_if_a_peer_died(self, refs: list[Any], pending: list[Any], failure: str) -> None:
        """A rank's call raised. If a peer died, that is why (a collective lost the peer), and the
        error may reach the driver before Ray reports the death. So each rank is checked, for at
        most death_grace_s: a call still running is awaited, any other rank asked `alive`. A dead
        rank raises TrainerDead naming each dead rank and node, then `failure`; the rank's error
        stays as its context. With every rank alive (or busy past the grace) this returns."""
        import ray

        probes = [ref if ref in pending else self.actors[r].alive.remote() for r, ref in enumerate(refs)]
        waiting, deaths = list(probes), list[tuple[int, BaseException]]()
        deadline = time.monotonic() + self.death_grace_s
        while waiting and not deaths:
            done, waiting = ray.wait(waiting, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not done:
                break
            if waiting:  # and the deaths known by now
                known, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=0)
                done += known
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    deaths.append((probes.index(ref), e))
                except Exception:
                    pass  # this rank's call failed too: it is alive
        if deaths:
            deaths.sort(key=lambda d: d[0])
            dead = "; ".join(self._died(r, e) for r, e in deaths)
            raise TrainerDead(f"{dead}; {failure}") from deaths[0][1]

    def fit(self, batch: list[Sample], version: int) -> dict[str, float]:
        import ray

        per_rank = self._all("fit", ray.put(batch), version)
        metrics = dict(per_rank[0])  # reduced over ranks: the same on each, but for memory
        for m in per_rank[1:]:
            metrics |= {k: v for k, v in m.items() if k.startswith("memory/")}
        return metrics

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        done = False
        while not done:
            bucket, done = self._all("next_weights", BUCKET_BYTES)[0]
            yield from bucket

    def save(self, directory: Path) -> None:
        self._all("save", str(directory))

    def load(self, directory: Path) -> None:
        self._all("load", str(directory))

    @property
    def fits_done(self) -> int:
        return self._all("fits_done")[0]

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
