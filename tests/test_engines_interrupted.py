"""A vLLM engine's requests cut short, each test on an engine of its own: a pause mid-generation
for new weights, after which the partial rollouts go on and each token keeps the version that
produced it; a call in flight when the engine process dies, which raises EngineDead instead
of waiting forever."""

import asyncio
from pathlib import Path

import psutil
import pytest
import torch

from rlexp.errors import EngineDead
from rlexp.sample import SamplingConfig
from tests.engine_helpers import (
    TEMPERATURE,
    _as_samples,
    _prompts,
    _publish,
    _record_n,
    _run_vllm,
    _trainer,
)

# vLLM's and torch's fp32 kernels on the scrambled model below (activations far larger than a
# trained model's) differ by up to 4e-4 on a token of its 200-token replies (measured: most
# tokens within 1e-5)
SCRAMBLED_TOL = 1e-3


def _mid_generation(engine, n: int, tokens: int) -> asyncio.Event:
    """Set once `n` requests have streamed `tokens` tokens from vLLM and are not finished."""
    generate, event, long = engine.llm.generate, asyncio.Event(), set()

    async def observed(*args, **kwargs):
        async for out in generate(*args, **kwargs):
            if len(out.outputs[0].token_ids) >= tokens and not out.finished:
                long.add(out.request_id)
                if len(long) >= n:
                    event.set()
            yield out

    engine.llm.generate = observed
    return event


@pytest.mark.vllm
def test_vllm_partial_rollout_tokens_keep_the_version_that_produced_them(tiny_model_path, tokenizer):
    """pause(interrupt=True) mid-generation, new weights, resume: generations continue; the
    tokens tagged with version 0 match the old weights' logprobs, version 1 the new ones.
    Each prompt's 4 samples went out as one request (vLLM's n).
    The tiny model answers in 2-3 tokens, too few to interrupt reliably: version 0 is the
    model with its weights scrambled, which rambles on for up to 200 tokens."""
    trainer = _trainer(tiny_model_path)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    old_state = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    prompts = [p for p in _prompts(tokenizer) for _ in range(4)]  # groups of 4: one request each

    async def check(engine):
        await _publish(trainer, engine, version=0)
        sent = _record_n(engine)
        running_on = asyncio.create_task(_mid_generation(engine, 1, tokens=8).wait())
        reqs = [asyncio.create_task(engine.generate(p, SamplingConfig(TEMPERATURE, 1.0, 200, seed=i)))
                for i, p in enumerate(prompts)]
        # (if every request ends first, nothing is mixed below and the test fails there)
        await asyncio.wait([running_on, asyncio.gather(*reqs)], return_when=asyncio.FIRST_COMPLETED)
        await engine.pause(interrupt=True)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        await _publish(trainer, engine, version=1)
        await engine.resume()
        return sent, await asyncio.gather(*reqs)

    sent, gens = _run_vllm(tiny_model_path, tokenizer, check)
    assert sent[:3] == [4, 4, 4]  # then the interrupted ones, each on its own
    assert all(len(g.token_ids) == len(g.logprobs) == len(g.versions) for g in gens)
    mixed = [(p, g) for p, g in zip(prompts, gens) if g.versions[0] == 0 and g.versions[-1] == 1]
    assert mixed, [(len(g.token_ids), set(g.versions)) for g in gens]
    assert all(g.versions == sorted(g.versions) for g in gens)
    samples = _as_samples([p for p, _ in mixed], [g for _, g in mixed])
    new_lp = trainer.sample_logprobs(samples)
    trainer.model.load_state_dict(old_state)
    old_lp = trainer.sample_logprobs(samples)
    apart = 0.0  # how far the old weights' logprobs are from those of the tokens tagged 1
    for (p, g), new, old in zip(mixed, new_lp, old_lp):
        v = torch.tensor(g.versions)
        got = torch.tensor(g.logprobs)
        assert (got[v == 0] - old[len(p):][v == 0]).abs().max() < SCRAMBLED_TOL
        assert (got[v == 1] - new[len(p):][v == 1]).abs().max() < SCRAMBLED_TOL
        apart = max(apart, (got[v == 1] - old[len(p):][v == 1]).abs().max().item())
    print(f"the old weights' logprobs of the tokens tagged 1: up to {apart:.3g} off")
    assert apart > 10 * SCRAMBLED_TOL  # versions are told apart


@pytest.mark.vllm
def test_a_call_in_flight_when_the_engine_process_dies_raises_engine_dead(tiny_model_path, tokenizer):
    """vLLM never fails a call into its engine process (collective_rpc, reset_prefix_cache,
    pause...) that is in flight when the process dies; rlexp's engine raises EngineDead, so the
    run stops and can resume, instead of waiting forever."""
    others = {p.pid for p in psutil.Process().children()}  # any engine this process already runs

    async def check(engine):
        (core,) = [p for p in psutil.Process().children()
                   if "EngineCore" in " ".join(p.cmdline()) and p.pid not in others]
        core.suspend()  # the call reaches the process and waits there for an answer
        call = asyncio.create_task(engine.load_weights(Path("/nonexistent"), version=1))
        while not engine.llm.engine_core.utility_results:  # vLLM's client: the call was sent, no answer yet
            await asyncio.sleep(0)
        assert not call.done()
        for p in [core] + core.children(recursive=True):
            p.kill()
        with pytest.raises(EngineDead, match="the vLLM engine process died"):
            await asyncio.wait_for(call, timeout=60)

    _run_vllm(tiny_model_path, tokenizer, check)
