"""Sampling for the Tinker API on rlexp's vLLM engine (token-in/token-out, with logprobs).

The engine holds one set of weights at a time: the base model's, or a training model's saved
with `save_weights_for_sampler`. A request for other weights waits until the requests on the
loaded ones are done, then the engine reloads in place (`VLLMEngine.load_weights`). Every load
of saved weights is verified as runs verify a sync: the trainer scored a probe sequence when
it saved them, the engine scores it after the load, and the largest |difference| of the
logprobs must be under the sync check's bound (rlexp/trainer/sync_check.py), else the sample
fails with SyncMismatch and the engine serves nothing from those weights."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rlexp.errors import SyncMismatch
from rlexp.sample import Generation, SamplingConfig
from rlexp.tinker import proto

PROBE_FILE = "probe.json"  # beside the sampler weights: the tokens and the trainer's logprobs of them
SENTINEL = (0, -99999.0)  # the SDK's "no value" cell of a top-k row


class Sampler:
    def __init__(self, engine: Any, base_dir: Path, bound: float,
                 on_sync: Callable[[Path, dict[str, float]], None]):
        self.engine, self.base_dir, self.bound, self.on_sync = engine, base_dir, bound, on_sync
        self.loaded: Path = base_dir
        self._inflight = 0
        self._cond = asyncio.Condition()
        self._versions = 0

    async def sample(self, weights: Path | None, prompt: list[int], n: int, sampling: SamplingConfig,
                     prompt_logprobs: bool, topk_prompt: int, last_n: int | None) -> bytes:
        """`n` completions of `prompt` (and its prompt logprobs) as the SDK's SampleResponse."""
        await self._acquire(weights or self.base_dir)
        try:
            seeds = [None if sampling.seed is None else sampling.seed + i for i in range(n)]
            calls = [self.engine.generate(prompt, _seeded(sampling, s)) for s in seeds]
            score = self.engine.score(prompt, topk_prompt) if prompt_logprobs or topk_prompt else None
            results = await asyncio.gather(*calls, *([score] if score is not None else []))
        finally:
            await self._release()
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

    async def _release(self) -> None:
        async with self._cond:
            self._inflight -= 1
            self._cond.notify_all()

    async def _load(self, weights: Path) -> None:
        self._versions += 1
        await self.engine.load_weights(weights, self._versions)
        self.loaded = weights
        probe_file = weights / PROBE_FILE
        if not probe_file.exists():
            return
        probe = json.loads(probe_file.read_text())
        served = (await self.engine.score(probe["tokens"])).logprobs
        diff = np.abs(np.asarray(served) - np.asarray(probe["logprobs"]))
        figures = {"sync/logprob_diff_max": float(diff.max()),
                   "sync/logprob_diff_p99": float(np.quantile(diff, 0.99)),
                   "sync/logprob_diff_mean": float(diff.mean()), "sync/tokens": float(len(diff))}
        self.on_sync(weights, figures)
        if figures["sync/logprob_diff_p99"] > self.bound:
            self.loaded = self.base_dir / "(unverified)"  # loaded, not trusted: the next request reloads
            raise SyncMismatch(f"the sampler weights at {weights} do not match the trainer's: the p99 of "
                               f"|logprob difference| on a {len(diff)}-token probe is "
                               f"{figures['sync/logprob_diff_p99']:.3g} (bound {self.bound:g}, as a run's "
                               "sync check)")


def _seeded(sampling: SamplingConfig, seed: int | None) -> SamplingConfig:
    from dataclasses import replace

    return replace(sampling, seed=seed)


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
