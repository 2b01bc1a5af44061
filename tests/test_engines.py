"""Rollout engines against the trainer: same tokens, same sampling-distribution logprobs,
before and after a weight update."""

import asyncio

import pytest
import torch

from rlexp.agents.single_turn import render_prompt
from rlexp.sample import Sample, SamplingConfig, Status
from rlexp.trainer.grpo import GRPOTrainer

TEMPERATURE = 0.7


def _prompts(tokenizer):
    return [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in ("12+3=", "7+25=", "0+0=")]


def _as_samples(prompts, gens):
    return [Sample(group_id=0, prompt=[], answer="", tokens=p + g.token_ids,
                   loss_mask=[0] * len(p) + [1] * len(g.token_ids), status=Status.COMPLETED)
            for p, g in zip(prompts, gens)]


def _max_logprob_diff(trainer, prompts, gens) -> float:
    samples = _as_samples(prompts, gens)
    ours = trainer.compute_old_logprobs(samples)
    diffs = [(lp[len(p):] - torch.tensor(g.logprobs)).abs().max().item()
             for p, g, lp in zip(prompts, gens, ours)]
    return max(diffs)


async def _check_engine(engine, trainer, tokenizer):
    prompts = _prompts(tokenizer)
    sampling = SamplingConfig(temperature=TEMPERATURE, top_p=1.0, max_tokens=12, seed=5)
    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in gens)
    assert all(g.finish_reason in ("stop", "length") and g.version == 0 for g in gens)
    before = _max_logprob_diff(trainer, prompts, gens)

    # Move the trainer's weights (a real optimizer step on random data), then sync.
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    stale = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    assert _max_logprob_diff(trainer, prompts, stale) > 1e-3  # the test can tell weights apart
    await trainer.sync_weights(engine)
    assert engine.version == 1
    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    after = _max_logprob_diff(trainer, prompts, gens)
    return before, after


def _trainer(path):
    return GRPOTrainer(path, temperature=TEMPERATURE, total_steps=1, track_ref_kl=False,
                       optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))


def test_hf_engine_logprobs_match_trainer(tiny_model_path, tokenizer):
    from rlexp.rollout.hf_engine import HFEngine

    engine = HFEngine(tiny_model_path)
    before, after = asyncio.run(_check_engine(engine, _trainer(tiny_model_path), tokenizer))
    assert before < 1e-4 and after < 1e-4


def _run_vllm(path, tokenizer, fn):
    from rlexp.rollout.vllm_engine import VLLMEngine

    async def main():
        engine = VLLMEngine(path, seed=0, max_model_len=256, kv_cache_gb=0.25, max_num_seqs=32)
        try:
            return await fn(engine)
        finally:
            engine.shutdown()

    return asyncio.run(main())


@pytest.mark.vllm
def test_vllm_logprobs_match_trainer_before_and_after_weight_update(tiny_model_path, tokenizer):
    trainer = _trainer(tiny_model_path)

    async def check(engine):
        seeded = SamplingConfig(temperature=1.0, max_tokens=8, seed=11)
        prompt = _prompts(tokenizer)[0]
        a, b = await asyncio.gather(engine.generate(prompt, seeded), engine.generate(prompt, seeded))
        assert a.token_ids == b.token_ids  # per-request seeds make rollouts reproducible
        return await _check_engine(engine, trainer, tokenizer)

    before, after = _run_vllm(tiny_model_path, tokenizer, check)
    assert before < 1e-4, before
    assert after < 1e-4, after


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_sleep_wake_keeps_synced_weights(tiny_model_path, tokenizer):
    from rlexp.rollout.vllm_engine import VLLMEngine

    trainer = _trainer(tiny_model_path)

    async def main():
        engine = VLLMEngine(tiny_model_path, enable_sleep_mode=True, gpu_memory_utilization=0.2)
        try:
            await engine.sleep()
            await engine.wake_up()
            return await _check_engine(engine, trainer, tokenizer)
        finally:
            engine.shutdown()

    before, after = asyncio.run(main())
    assert before < 1e-4 and after < 1e-4
