"""Planted weight-sync faults: each a way a sync returns success and leaves the vLLM engine
serving other numbers than the trainer's weights give (what rlexp/trainer/sync_check.py is
for). `plant` runs one: a real update, the faulty push, a batch at the new version, the fit.
Used by the engine modules' tests (test_engines.py, test_lora_engine.py, test_moe.py) and by
bench/sync_faults.py.

What each leaves stale in vLLM 0.32 (CPU), found by comparing the engine's logprobs with the
trainer's under mixed weights:
- `lm_head_left_out`: a tied model's push without `lm_head.weight`. vLLM's layer-wise reload
  loads the embedding and puts the lm_head layer's old tensor back ("ParallelLMHead: Failed to
  load weights", a log warning): the output projection stays stale, the tie is broken until a
  full push. Leaving out `embed_tokens.weight` instead is harmless: the lm_head's load fills
  the tied tensor. (With ram_file the omission must be there from the transport's first sync:
  after it, the file's header keeps lm_head as an alias of the embedding.)
- `lora_not_merged`: the base weights pushed, the adapters left out.
- `experts_not_repacked`: the push through vLLM's own `reload_weights`, without rlexp's CPU
  MoE repack (rlexp/weights/vllm_private.py): scrambled experts, also for unchanged weights.
  vLLM can run no test code in its worker process, so the repack is skipped by taking vLLM's
  path, not by patching rlexp's.
- `kv_reused`: the reload and the new version announced, without `VLLMEngine.weights_loaded`'s
  cache reset, and the requests' prefix-cache salt stuck at the old version (a salt that never
  moves): a prompt seen before the push reuses KV computed by the old weights (prompts longer
  than one KV block, 128 tokens on the CPU, are cached). Either protection alone is enough:
  the reset where no request holds KV, the salt always (tests/test_engines_interrupted.py). A
  vision-language model's image encoder cache kept is no silent fault: the next request with
  a seen image kills the engine ("Encoder cache miss").
- `nothing_sent`: a transport that returns without writing (tests.fakes.StopsSending): the
  engine reloads the last sync's file and announces the new version.
- `rounded_to_bfloat16`: a float32 run whose weights are cast to bfloat16 on the way."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rlexp.chat.render import render_prompt
from rlexp.errors import SyncMismatch
from rlexp.rollout import vllm_engine
from rlexp.sample import Sample, SamplingConfig, Status, TokenTrace
from rlexp.trainer.lora import merged_weights
from rlexp.trainer.sync_check import AUTO_BOUNDS, SyncCheck
from rlexp.weights.files import save_safetensors
from rlexp.weights.ram_file import RamFileTransport
from tests.fakes import StopsSending

# (trainer, engine, the run's transport (its first sync written), version): the faulty push
Fault = Callable[..., Awaitable[None]]


async def _push(weights, engine, version: int) -> None:
    """A sync through a new ram_file transport (its first)."""
    transport = RamFileTransport()
    try:
        await transport.transfer(weights, engine, version)
    finally:
        transport.close()


async def correct(trainer, engine, last, version: int) -> None:
    """The control: the trainer's weights, as the loop pushes them."""
    await _push(trainer.weights(), engine, version)


async def lm_head_left_out(trainer, engine, last, version: int) -> None:
    await _push(((n, t) for n, t in trainer.weights() if n != "lm_head.weight"), engine, version)


async def lora_not_merged(trainer, engine, last, version: int) -> None:
    """The policy's base weights under the base model's names: W, not W + scaling * B @ A."""
    await _push(merged_weights(trainer.model.state_dict().items(), scaling=0.0), engine, version)


async def rounded_to_bfloat16(trainer, engine, last, version: int) -> None:
    await _push(((n, t.to(torch.bfloat16)) for n, t in trainer.weights()), engine, version)


async def nothing_sent(trainer, engine, last: StopsSending, version: int) -> None:
    assert last.sends == 0  # it wrote the first sync's file and writes no more
    await last.transfer(trainer.weights(), engine, version)


async def kv_reused(trainer, engine, last, version: int) -> None:
    """rlexp's reload of the pushed weights, then `version` announced (the engine's and vLLM's
    token labels) with no cache reset, and every later request salted as the version before
    (`plant` puts the salt back)."""
    stuck = vllm_engine.cache_salt(engine.version)
    transport = RamFileTransport()
    try:
        transport.file.write(trainer.weights())
        await engine.llm.collective_rpc("load_shared_weights", args=(str(transport.directory),))
        await engine.llm.update_weight_version(str(version))
        engine.version = version
        vllm_engine.cache_salt = lambda version: stuck
    finally:
        transport.close()


async def experts_not_repacked(trainer, engine, last, version: int) -> None:
    """vLLM's own reload from a file (`reload_weights(weights_path=...)`, which also points the
    worker's model config at that path), then rlexp's cache resets and version."""
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        save_safetensors(trainer.weights(), Path(d))  # tied tensors written under both names
        await engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
    await engine.weights_loaded(version)


def history_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    """Each question after five solved ones: ~150 tokens, more than a KV block (128 on the
    CPU), so a repeated prompt hits the prefix cache."""
    solved = []
    for q, a in (("12+3=", "15"), ("7+25=", "32"), ("9+9=", "18"), ("1+20=", "21"), ("6+5=", "11")):
        solved += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return [render_prompt(tokenizer, solved + [{"role": "user", "content": q}]) for q in questions]


def generate(engine, run, prompts: list[list[int]], max_tokens: int, temperature: float) -> list[Sample]:
    """One sample per prompt from the engine (seeded; the same seeds at every version), in
    groups of two with rewards 0 and 1: every sample carries a training signal."""
    async def gather():
        return await asyncio.gather(*(engine.generate(p, SamplingConfig(temperature, 1.0, max_tokens, seed=i))
                                      for i, p in enumerate(prompts)))

    samples = []
    for i, (p, g) in enumerate(zip(prompts, run(gather()))):
        trace = TokenTrace()
        trace.append(p, role="prompt")
        trace.append(g.token_ids, role="assistant", generation=g)
        samples.append(Sample(group_id=i // 2, prompt=[], answer="", trace=trace, status=Status.COMPLETED,
                              reward=float(i % 2)))
    return samples


@dataclass
class Outcome:
    healthy: dict[str, float]  # the fit at version 0 (a correct sync), the trainer's check
    versions: set[int]  # the versions the engine tagged the batch after the faulty push with
    error: SyncMismatch | None  # what the fit at version 1 raised with the trainer's check
    went_on: dict[str, float]  # that fit's metrics, with the check off where it raised


def plant(fault: Fault, trainer, engine, run, prompts: list[list[int]], temperature: float,
          max_tokens: int = 8) -> Outcome:
    """The trainer's weights pushed (version 0), a batch from the engine (sampled at the
    trainer's `temperature`) and a real update; then `fault`'s push (version 1), a batch of
    the same prompts and the fit. The engine gets the trainer's first weights back (version 0,
    caches reset) however it ends."""
    start = [(n, t.detach().clone()) for n, t in trainer.weights()]
    salt = vllm_engine.cache_salt
    first = StopsSending(sends=1)
    try:
        run(first.transfer(trainer.weights(), engine, 0))
        healthy = trainer.fit(generate(engine, run, prompts, max_tokens, temperature), 0)
        run(fault(trainer, engine, first, 1))
        batch = generate(engine, run, prompts, max_tokens, temperature)
        versions = {v for s in batch for v, m in zip(s.trace.versions, s.loss_mask) if m}
        error = None
        try:
            went_on = trainer.fit(batch, 1)
        except SyncMismatch as e:  # stopped before the optimizer step: the same fit, unchecked
            error = e
            trainer.learner = replace(trainer.learner, sync_check=SyncCheck(bound="off"))
            went_on = trainer.fit(batch, 1)
        return Outcome(healthy, versions, error, went_on)
    finally:
        first.close()
        vllm_engine.cache_salt = salt
        run(_push(start, engine, 0))


def assert_caught(name: str, out) -> None:
    """`plant`'s outcome in float32: the correct sync passed (the check was on), the engine
    announced the new version, the next fit stopped naming it, and with the check off the
    same fit trained on past the bound (the run would have gone on)."""
    print(f"\n[sync] {name}: p99 |logprob diff| {out.healthy['sync/logprob_diff_p99']:.1e} at a correct "
          f"sync, {out.went_on['sync/logprob_diff_p99']:.2e} after the faulty one")
    assert out.healthy["sync/tokens"] > 0 and out.healthy["sync/logprob_diff_p99"] < 1e-5
    assert out.versions == {1}
    assert out.error is not None and "policy version 1 did not land" in str(out.error)
    assert out.went_on["sync/logprob_diff_p99"] > AUTO_BOUNDS["float32"]
    assert out.went_on["train/skipped_step"] == 0.0
