"""Sampling for the Tinker API on rlexp's vLLM engine (token-in/token-out, with logprobs).

Sampler weights come in two kinds (rlexp/tinker/training.py writes them):
- **a LoRA adapter** (peft's files): served by the engine on its one base model, by name, next
  to every other tenant's; requests for different adapters run concurrently, nothing is
  reloaded. The engine keeps up to `max_adapters` (rollout.max_cpu_loras) loaded, the least
  recently used not in use removed first; a removed one is loaded again at its next request.
- **a whole model** (a full fine-tune's, or a LoRA model's merged where the engine cannot serve
  its adapter): the engine holds one such set of weights at a time. A request for other
  weights waits until the requests on the loaded ones are done, then the engine reloads in
  place (`VLLMEngine.load_weights`); adapters are served on the base model only.

Every load of saved weights is verified as runs verify a sync: the trainer scored a probe
sequence when it saved them, the engine scores it after the load, and the p99 of the
|differences| of the logprobs must be under the sync check's bound
(rlexp/trainer/sync_check.py), else the sample fails with SyncMismatch and the engine serves
nothing from those weights."""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rlexp.errors import SyncMismatch
from rlexp.sample import Generation, SamplingConfig
from rlexp.tinker import proto
from rlexp.tinker.errors import BadRequest
from rlexp.weights.adapter_file import ADAPTER_CONFIG

KEEP_EPHEMERAL = 3  # unnamed sampler weights kept per model (older ones are deleted: models.py)
PROBE_FILE = "probe.json"  # beside the sampler weights: the tokens and the trainer's logprobs of them
SENTINEL = (0, -99999.0)  # the SDK's "no value" cell of a top-k row


class Sampler:
    def __init__(self, engine: Any, base_dir: Path, bound: float,
                 on_sync: Callable[[Path, dict[str, float]], None], max_adapters: int = 4):
        self.engine, self.base_dir, self.bound, self.on_sync = engine, base_dir, bound, on_sync
        self.max_adapters = max_adapters
        self.loaded: Path = base_dir  # the whole model the engine holds
        self.adapters: OrderedDict[Path, str] = OrderedDict()  # loaded, least recently used first
        self._users: dict[str, int] = {}  # adapter name -> requests using it now
        self._inflight = 0
        self._cond = asyncio.Condition()
        self._versions = 0
        self._names = 0

    async def sample(self, weights: Path | None, prompt: list[int], n: int, sampling: SamplingConfig,
                     prompt_logprobs: bool, topk_prompt: int, last_n: int | None) -> bytes:
        """`n` completions of `prompt` (and its prompt logprobs) as the SDK's SampleResponse."""
        if weights is not None and not weights.is_dir():
            raise BadRequest(f"the sampler weights at {weights} were deleted (a model keeps the last "
                             f"{KEEP_EPHEMERAL} unnamed ones it saved): save them again",
                             "sampling_session_id", 404)
        adapter = weights is not None and is_adapter(weights)
        await self._acquire(self.base_dir if adapter or weights is None else weights)
        name = None
        try:
            if adapter:
                assert weights is not None
                name = await self._adapter(weights)
            sampling = replace(sampling, adapter=name)
            seeds = [None if sampling.seed is None else sampling.seed + i for i in range(n)]
            calls = [self.engine.generate(prompt, replace(sampling, seed=s)) for s in seeds]
            score = self.engine.score(prompt, topk_prompt, name) if prompt_logprobs or topk_prompt else None
            results = await asyncio.gather(*calls, *([score] if score is not None else []))
        finally:
            await self._release(name)
        generations: list[Generation] = list(results[:n])
        scores = results[n] if score is not None else None
        return _response(generations, prompt, scores, prompt_logprobs, topk_prompt, last_n, sampling)

    async def _acquire(self, weights: Path) -> None:
        async with self._cond:
            while self.loaded != weights and self._inflight:
                await self._cond.wait()
            if self.loaded != weights:
                self._inflight += 1  # nobody else swaps meanwhile
                try:
                    await self._load(weights)
                finally:
                    self._inflight -= 1
            self._inflight += 1

    async def _release(self, adapter: str | None) -> None:
        async with self._cond:
            self._inflight -= 1
            if adapter is not None:
                self._users[adapter] -= 1
            self._cond.notify_all()

    async def _adapter(self, weights: Path) -> str:
        """The engine's name of the adapter in `weights`, loaded (and verified) if it is not;
        counted as in use until `_release`."""
        async with self._cond:
            if weights in self.adapters:
                self.adapters.move_to_end(weights)
            else:
                await self._evict(self.max_adapters - 1)
                self._names += 1
                name = f"tenant-{self._names}"
                await self.engine.load_adapter(name, weights)
                self.adapters[weights] = name
                self._users[name] = 0
                try:
                    await self._verify(weights, name)
                except SyncMismatch:
                    await self._remove(weights)
                    raise
            name = self.adapters[weights]
            self._users[name] += 1
            return name

    async def _evict(self, keep: int) -> None:
        """Remove the least recently used adapters not in use until `keep` are left (or all
        the others are in use)."""
        idle = [w for w, name in self.adapters.items() if not self._users[name]]
        for weights in idle[:max(len(self.adapters) - keep, 0)]:
            await self._remove(weights)

    async def _remove(self, weights: Path) -> None:
        name = self.adapters.pop(weights)
        del self._users[name]
        await self.engine.remove_adapter(name)

    async def _load(self, weights: Path) -> None:
        self._versions += 1
        await self.engine.load_weights(weights, self._versions)
        self.loaded = weights
        try:
            await self._verify(weights, None)
        except SyncMismatch:
            self.loaded = self.base_dir / "(unverified)"  # loaded, not trusted: the next request reloads
            raise

    async def _verify(self, weights: Path, adapter: str | None) -> None:
        """The engine's logprobs of the probe saved with `weights` against the trainer's."""
        probe_file = weights / PROBE_FILE
        if not probe_file.exists():
            return
        probe = json.loads(probe_file.read_text())
        served = (await self.engine.score(probe["tokens"], 0, adapter)).logprobs
        diff = np.abs(np.asarray(served) - np.asarray(probe["logprobs"]))
        figures = {"sync/logprob_diff_max": float(diff.max()),
                   "sync/logprob_diff_p99": float(np.quantile(diff, 0.99)),
                   "sync/logprob_diff_mean": float(diff.mean()), "sync/tokens": float(len(diff))}
        self.on_sync(weights, figures)
        if figures["sync/logprob_diff_p99"] > self.bound:
            raise SyncMismatch(f"the sampler weights at {weights} do not match the trainer's: the p99 of "
                               f"|logprob difference| on a {len(diff)}-token probe is "
                               f"{figures['sync/logprob_diff_p99']:.3g} (bound {self.bound:g}, as a run's "
                               "sync check)")


def is_adapter(weights: Path) -> bool:
    """Sampler weights saved as a LoRA adapter (peft's files), not a whole model."""
    return (weights / ADAPTER_CONFIG).exists()


def _response(generations: list[Generation], prompt: list[int], scores: Any, prompt_logprobs: bool,
              topk_prompt: int, last_n: int | None, sampling: SamplingConfig) -> bytes:
    out = proto.SampleResponse()
    for g in generations:
        seq = out.sequences.add(stop_reason=proto.LENGTH if g.finish_reason == "length" else proto.STOP,
                                tokens=np.asarray(g.token_ids, "<i4").tobytes(),
                                logprobs=np.asarray(g.logprobs, "<f4").tobytes())
        if sampling.top_logprobs:
            seq.topk_sampled_logprobs.CopyFrom(_topk(g.top_logprobs or [], sampling.top_logprobs, lead=0))
    if scores is not None:
        scored = np.full(len(prompt), np.nan, "<f4")
        scored[1:] = scores.logprobs
        if last_n is not None:
            scored[:max(len(prompt) - last_n, 1)] = np.nan
        if prompt_logprobs:
            out.prompt_logprobs = scored.tobytes()
        if topk_prompt:
            out.topk_prompt_logprobs.CopyFrom(_topk(scores.top or [], topk_prompt, lead=1))
    return out.SerializeToString()


def _topk(rows: list[dict[int, float]], k: int, lead: int) -> Any:
    """[lead + len(rows), k] likeliest ids and logprobs, best first; `lead` sentinel rows first
    (position 0 of a prompt: nothing predicts it) and sentinel cells where a row has fewer."""
    ids = np.full((lead + len(rows), k), SENTINEL[0], "<i4")
    lps = np.full((lead + len(rows), k), SENTINEL[1], "<f4")
    for i, row in enumerate(rows):
        best = sorted(row.items(), key=lambda kv: -kv[1])[:k]
        for j, (tid, lp) in enumerate(best):
            ids[lead + i, j], lps[lead + i, j] = tid, lp
    return proto.TopkLogprobs(token_ids=ids.tobytes(), logprobs=lps.tobytes(), k=k, length=len(ids))
