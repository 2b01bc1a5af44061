"""A vLLM engine's requests across a weight update, each test on an engine of its own: a pause
mid-generation (abort: cut short and sent again; keep: frozen with their KV cache) for new
weights, after which the generations go on and each token keeps the version that produced it;
a request sent after a keep update, which never reuses the KV the old weights wrote; a call in
flight when the engine process dies, which raises EngineDead instead of waiting forever."""

import asyncio
from pathlib import Path

import psutil
import pytest
import torch

from rlexp.chat.render import render_prompt
from rlexp.errors import EngineDead, SyncMismatch
from rlexp.rollout.vllm_engine import cache_salt
from rlexp.sample import SamplingConfig
from rlexp.weights.ram_file import RamFileTransport
from tests.engine_helpers import (
    ENGINE_KW,
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


def _scrambled_trainer(path):
    """The tiny model answers in 2-3 tokens, too few to pause mid-generation reliably: its
    weights scrambled, it rambles on for up to 200 tokens."""
    trainer = _trainer(path)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return trainer


async def _new_weights(trainer, engine, mode: str) -> None:
    """The loop's update under `mode`: pause, move the weights, publish version 1, resume."""
    await engine.pause(mode)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    await _publish(trainer, engine, version=1)
    await engine.resume()


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_vllm_tokens_across_an_update_keep_the_version_that_produced_them(tiny_model_path, tokenizer, mode):
    """A pause mid-generation, new weights, resume: generations continue; the tokens tagged with
    version 0 match the old weights' logprobs. abort: each cut-short request is sent again (its
    prompt and tokens prefilled under the new weights), and the tokens tagged 1 match the new
    weights' logprobs. keep: nothing is sent again; the tokens tagged 1 are the new weights'
    over KV the old ones wrote, marked mixed from the first of them. Each prompt's 4 samples
    went out as one request (vLLM's n)."""
    trainer = _scrambled_trainer(tiny_model_path)
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
        await _new_weights(trainer, engine, mode)
        return sent, await asyncio.gather(*reqs)

    sent, gens = _run_vllm(tiny_model_path, tokenizer, check)
    # abort: then the interrupted ones, each on its own; keep: none again
    assert sent[:3] == [4, 4, 4] and (len(sent) > 3) == (mode == "abort")
    assert all(len(g.token_ids) == len(g.logprobs) == len(g.versions) for g in gens)
    across = [(p, g) for p, g in zip(prompts, gens) if g.versions[0] == 0 and g.versions[-1] == 1]
    assert across, [(len(g.token_ids), set(g.versions)) for g in gens]
    assert all(g.versions == sorted(g.versions) for g in gens)
    for _, g in across:
        first_new = g.versions.index(1)
        assert (g.mixed_from, g.context_version) == ((first_new, 0) if mode == "keep" else (None, None))
    samples = _as_samples([p for p, _ in across], [g for _, g in across])
    new_lp = trainer.sample_logprobs(samples)
    trainer.model.load_state_dict(old_state)
    old_lp = trainer.sample_logprobs(samples)
    apart = 0.0  # how far the old weights' logprobs are from those of the tokens tagged 1
    for (p, g), new, old in zip(across, new_lp, old_lp):
        v = torch.tensor(g.versions)
        got = torch.tensor(g.logprobs)
        assert (got[v == 0] - old[len(p):][v == 0]).abs().max() < SCRAMBLED_TOL
        if mode == "abort":
            assert (got[v == 1] - new[len(p):][v == 1]).abs().max() < SCRAMBLED_TOL
        apart = max(apart, (got[v == 1] - old[len(p):][v == 1]).abs().max().item())
    print(f"the old weights' logprobs of the tokens tagged 1: up to {apart:.3g} off")
    assert apart > 10 * SCRAMBLED_TOL  # versions are told apart


@pytest.mark.vllm
def test_a_request_sent_after_a_keep_update_reuses_no_kv_of_the_old_weights(tiny_model_path, tokenizer):
    """A long prompt's KV, cached by a request at version 0 that the keep update froze (so no
    reset can drop it), is reachable after the update by a request salted as version 0 (vLLM's
    `num_cached_tokens`), never by the engine's next request: that one's logprobs are the new
    weights' (the trainer's, to the kernels' tolerance), not mixed."""
    from vllm import SamplingParams

    trainer = _scrambled_trainer(tiny_model_path)
    long_prompt = render_prompt(tokenizer, [{"role": "user", "content": "12+3=" * 28}])

    async def cached_tokens(engine, salt: str) -> int:
        params = SamplingParams(max_tokens=1, temperature=0)
        async for out in engine.llm.generate({"prompt_token_ids": long_prompt, "cache_salt": salt},
                                             params, request_id=f"probe-{salt}"):
            final = out
        return final.num_cached_tokens

    async def check(engine):
        block = engine.llm.vllm_config.cache_config.block_size
        assert len(long_prompt) >= block, (len(long_prompt), block)  # a whole block to cache
        await _publish(trainer, engine, version=0)
        running_on = asyncio.create_task(_mid_generation(engine, 1, tokens=8).wait())
        rest = ENGINE_KW["max_model_len"] - len(long_prompt)  # rambling on to the end
        sampling = SamplingConfig(TEMPERATURE, 1.0, rest, seed=1)
        old = asyncio.create_task(engine.generate(long_prompt, sampling))
        await asyncio.wait([running_on, old], return_when=asyncio.FIRST_COMPLETED)
        assert not old.done()
        await _new_weights(trainer, engine, "keep")
        new = await engine.generate(long_prompt, SamplingConfig(TEMPERATURE, 1.0, 8, seed=2))
        return await cached_tokens(engine, cache_salt(0)), new, await old

    reachable, new, old = _run_vllm(tiny_model_path, tokenizer, check)
    assert reachable > 0  # the old weights' KV of the prompt was there to reuse
    assert set(new.versions) == {1} and new.mixed_from is None
    assert old.versions[0] == 0 and old.mixed_from is not None  # it went on over its old KV
    (lp,) = trainer.sample_logprobs(_as_samples([long_prompt], [new]))
    assert (torch.tensor(new.logprobs) - lp[len(long_prompt):]).abs().max() < SCRAMBLED_TOL


def _graded(samples):
    """Groups of two with rewards 0 and 1: every sample carries a training signal."""
    for i, s in enumerate(samples):
        s.group_id, s.reward = i // 2, float(i % 2)
    return samples


async def _keep_update(engine, prompts, weights, version: int):
    """Long generations, a keep update to `version` mid-way pushing `weights`, then short
    requests sent after it: (the generations that crossed it, the requests after it)."""
    running_on = asyncio.create_task(_mid_generation(engine, 1, tokens=8).wait())
    long = [SamplingConfig(TEMPERATURE, 1.0, 120, seed=10 * version + i) for i in range(len(prompts))]
    crossing = [asyncio.create_task(engine.generate(p, sampling)) for p, sampling in zip(prompts, long)]
    await asyncio.wait([running_on, asyncio.gather(*crossing)], return_when=asyncio.FIRST_COMPLETED)
    await engine.pause("keep")
    transport = RamFileTransport()
    try:
        await transport.transfer(weights, engine, version)
    finally:
        transport.close()
    await engine.resume()
    after = [engine.generate(p, SamplingConfig(TEMPERATURE, 1.0, 8, seed=10 * version + 5 + i))
             for i, p in enumerate(prompts)]
    return await asyncio.gather(*crossing), await asyncio.gather(*after)


def _moved(trainer) -> list:
    """The trainer's weights moved (as by an update); its weights before."""
    before = [(n, t.detach().clone()) for n, t in trainer.weights()]
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return before


@pytest.mark.vllm
def test_the_sync_check_skips_mixed_tokens_and_catches_a_bad_keep_update(tiny_model_path, tokenizer):
    """Keep updates mid-generation, each followed by a batch of the generations that crossed it
    (tokens of the version before, then mixed ones) and of requests sent after it. A correct
    push (version 1): the fit's sync check compares only the requests sent after it, and
    passes. A push that did not land (version 2: the engine keeps version 1's weights): it
    stops the fit."""
    trainer = _scrambled_trainer(tiny_model_path)
    prompts = _prompts(tokenizer)

    async def check(engine):
        await _publish(trainer, engine, version=0)
        _moved(trainer)
        first = await _keep_update(engine, prompts, trainer.weights(), 1)
        landed = trainer.fit(_graded(_as_samples(prompts + prompts, first[0] + first[1])), 1)
        kept = _moved(trainer)
        second = await _keep_update(engine, prompts, iter(kept), 2)
        return first, landed, second

    (crossed, after), landed, (crossed_2, after_2) = _run_vllm(tiny_model_path, tokenizer, check)
    assert any(g.mixed_from is not None for g in crossed + crossed_2)
    # the mixed tokens, version 1's own, are no single version's: left out
    assert 0 < landed["sync/tokens"] <= sum(len(g.token_ids) for g in after)
    assert landed["sync/logprob_diff_p99"] < SCRAMBLED_TOL
    with pytest.raises(SyncMismatch, match="policy version 2 did not land"):
        trainer.fit(_graded(_as_samples(prompts + prompts, crossed_2 + after_2)), 2)


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
