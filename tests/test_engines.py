"""Rollout engines against the trainer: same tokens, same sampling-distribution logprobs,
before and after a weight update."""

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from rlexp.chat.render import render_prompt
from rlexp.errors import EngineDead
from rlexp.sample import Sample, SamplingConfig, Status, TokenTrace
from rlexp.trainer.controller import TrainController
from rlexp.weights.files import save_safetensors
from rlexp.weights.ram_file import RamFileTransport
from tests import sync_faults
from tests.conftest import vllm_on_thread

TEMPERATURE = 0.7


def _prompts(tokenizer):
    return [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in ("12+3=", "7+25=", "0+0=")]


def _as_samples(prompts, gens):
    samples = []
    for p, g in zip(prompts, gens):
        trace = TokenTrace()
        trace.append(p, role="prompt")
        trace.append(g.token_ids, role="assistant", generation=g)
        samples.append(Sample(group_id=0, prompt=[], answer="", trace=trace, status=Status.COMPLETED))
    return samples


async def _publish(trainer, engine, version, transport=None):
    """The loop's weight sync: the trainer's weights through a transport (the RAM file's
    by default)."""
    transport = transport or RamFileTransport()
    try:
        await transport.transfer(trainer.weights(), engine, version)
    finally:
        transport.close()
    if isinstance(transport, RamFileTransport):
        assert not transport.directory.exists()  # nothing left in /dev/shm


def _max_logprob_diff(trainer, prompts, gens) -> float:
    samples = _as_samples(prompts, gens)
    ours = trainer.sample_logprobs(samples)
    diffs = [(lp[len(p):] - torch.tensor(g.logprobs)).abs().max().item()
             for p, g, lp in zip(prompts, gens, ours)]
    return max(diffs)


async def _check_engine(engine, trainer, tokenizer, transport=None):
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
    await _publish(trainer, engine, 3, transport)  # the loop's number: the engine counts nothing
    assert engine.version == 3
    gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
    assert all(g.versions == [3] * len(g.token_ids) for g in gens)
    after = _max_logprob_diff(trainer, prompts, gens)
    return before, after


def _trainer(path):
    return TrainController(path, temperature=TEMPERATURE, total_steps=1, ref_kl_every_n_steps=0,
                       optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))


def test_hf_engine_logprobs_match_trainer(tiny_model_path, tokenizer):
    from rlexp.rollout.hf_engine import HFEngine

    engine = HFEngine(tiny_model_path, seed=0)
    before, after = asyncio.run(_check_engine(engine, _trainer(tiny_model_path), tokenizer))
    assert before < 1e-4 and after < 1e-4


ENGINE_KW = dict(seed=0, max_model_len=256, kv_cache_gb=0.25, max_num_seqs=32)


def _owned_files(engine) -> list[str]:
    """vLLM's sockets are in the engine's own directory, its shared memory (if any) listed there."""
    owned = (engine._temp / ".owned").read_text().split()
    assert [f for f in os.listdir(engine._temp) if not f.startswith(".")]
    assert all(p.startswith("/dev/shm/psm_") or "vllm" in p for p in owned), owned
    return owned


def _engine_processes(others: set[int]) -> list[str]:
    """The process titles vLLM gave this process's descendants, but `others`."""
    titles = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True) if p.pid not in others]
    return sorted(t.split()[0] for t in titles if t.startswith("VLLM::"))


def _left_nothing(engine, owned: list[str]) -> None:
    """After shutdown: the engine's directory and shared memory are gone."""
    assert not engine._temp.exists() and not [p for p in owned if os.path.exists(p)]


def _run_vllm(path, tokenizer, fn):
    """A new engine for a test that leaves it unusable or needs it fresh."""
    from rlexp.rollout.vllm_engine import VLLMEngine

    async def main():
        engine = VLLMEngine(path, **ENGINE_KW)
        owned = _owned_files(engine)
        try:
            return await fn(engine)
        finally:
            engine.shutdown()
            _left_nothing(engine, owned)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def tiny_vllm(tiny_model_path, tmp_path_factory):
    """One engine for the module's tests that leave it as they found it (the built weights,
    version 0); `reset()` pushes the built weights back."""
    others = {p.pid for p in psutil.Process().children(recursive=True)}
    with vllm_on_thread(tiny_model_path, 600, **ENGINE_KW) as (engine, run):
        owned = _owned_files(engine)
        assert _engine_processes(others) == ["VLLM::EngineCore"]
        built = tmp_path_factory.mktemp("built")
        save_safetensors(_trainer(tiny_model_path).weights(), built)  # lm_head too (tied)

        def reset():
            run(engine.load_weights(built, version=0))

        yield SimpleNamespace(engine=engine, run=run, reset=reset)
    _left_nothing(engine, owned)


@pytest.mark.vllm
def test_vllm_logprobs_match_trainer_before_and_after_weight_update(tiny_vllm, tiny_model_path, tokenizer):
    trainer = _trainer(tiny_model_path)

    async def check(engine):
        seeded = SamplingConfig(temperature=1.0, max_tokens=8, seed=11)
        prompt = _prompts(tokenizer)[0]
        a, b = await asyncio.gather(engine.generate(prompt, seeded), engine.generate(prompt, seeded))
        assert a.token_ids == b.token_ids  # per-request seeds make rollouts reproducible
        # on the CPU the worker runs in the engine core's process: no second process, no queue to busy-poll
        assert await engine.llm.collective_rpc("set_idle_spin", args=(0.05,)) == [0]
        return await _check_engine(engine, trainer, tokenizer)

    try:
        before, after = tiny_vllm.run(check(tiny_vllm.engine))
    finally:
        tiny_vllm.reset()
    assert before < 1e-4, before
    assert after < 1e-4, after


def _record_n(engine) -> list[int]:
    """The `n` of every request the engine sends to vLLM from now on."""
    generate, sent = engine.llm.generate, []

    def recorded(prompt, params, *args, **kwargs):
        sent.append(params.n)
        return generate(prompt, params, *args, **kwargs)

    engine.llm.generate = recorded
    return sent


@pytest.mark.vllm
def test_a_groups_requests_go_out_as_one_and_each_sample_gets_its_own_requests_tokens(tiny_vllm, tokenizer):
    """Concurrent requests for one prompt with consecutive seeds are one vLLM request with n;
    each gets the tokens and logprobs its own request gives, whatever else runs beside it."""
    engine, prompt = tiny_vllm.engine, _prompts(tokenizer)[1]

    def sampling(seed):
        return SamplingConfig(temperature=1.0, max_tokens=8, seed=seed)

    async def check():
        sent = _record_n(engine)
        try:
            grouped = await asyncio.gather(*(engine.generate(prompt, sampling(100 + i)) for i in range(6)))
            alone = [await engine.generate(prompt, sampling(100 + i)) for i in range(6)]
            apart = await asyncio.gather(*(engine.generate(prompt, sampling(100 + 2 * i)) for i in range(3)))
        finally:
            del engine.llm.generate  # the instance attribute: vLLM's method again
        return sent, grouped, alone, apart

    sent, grouped, alone, apart = tiny_vllm.run(check())
    assert sent == [6] + [1] * 6 + [1] * 3
    assert [g.token_ids for g in grouped] == [g.token_ids for g in alone]
    assert len({tuple(g.token_ids) for g in alone}) > 1  # the seeds differ: so do the samples
    assert [g.finish_reason for g in grouped] == [g.finish_reason for g in alone]
    diff = max(abs(a - b) for g, s in zip(grouped, alone) for a, b in zip(g.logprobs, s.logprobs))
    assert diff < 1e-5 and all(g.versions == [0] * len(g.token_ids) for g in grouped)
    assert [g.token_ids for g in apart] == [alone[0].token_ids, alone[2].token_ids, alone[4].token_ids]


@pytest.mark.vllm
@pytest.mark.parametrize("fault", [sync_faults.lm_head_left_out, sync_faults.caches_kept,
                                   sync_faults.nothing_sent, sync_faults.rounded_to_bfloat16],
                         ids=lambda f: f.__name__)
def test_a_faulty_weight_sync_stops_the_next_fit(tiny_vllm, tiny_model_path, tokenizer, fault):
    """A real update, then a push that returns success but leaves the engine serving other
    numbers (tests/sync_faults.py: a tied lm_head left out, the prefix cache not reset after
    the reload, a transport that sent nothing, a float32 run's weights cast to bfloat16 on the
    way): the next fit, on a batch the engine generated at the new version, stops with
    SyncMismatch; with the check off the run would have gone on."""
    trainer = _trainer(tiny_model_path)
    prompts = sync_faults.history_prompts(tokenizer, ["4+13=", "4+13=", "21+5=", "21+5="])
    out = sync_faults.plant(fault, trainer, tiny_vllm.engine, tiny_vllm.run, prompts, TEMPERATURE)
    sync_faults.assert_caught(fault.__name__, out)


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_sleep_wake_keeps_synced_weights(tiny_model_path, tokenizer):
    from rlexp.rollout.vllm_engine import VLLMEngine

    trainer = _trainer(tiny_model_path)

    async def main():
        engine = VLLMEngine(tiny_model_path, seed=0, enable_sleep_mode=True, gpu_memory_utilization=0.2)
        try:
            await engine.sleep()
            await engine.wake_up()
            return await _check_engine(engine, trainer, tokenizer)
        finally:
            engine.shutdown()

    before, after = asyncio.run(main())
    assert before < 1e-4 and after < 1e-4


@pytest.mark.gpu
@pytest.mark.vllm
def test_vllm_native_ipc_transport_carries_the_trainers_weights(tiny_model_path, tokenizer):
    """GPU: vLLM's CUDA-IPC weight transfer (weight_transfer=vllm_ipc) instead of the RAM file."""
    from rlexp.rollout.vllm_engine import VLLMEngine
    from rlexp.weights.vllm_ipc import VllmIpcTransport

    trainer = _trainer(tiny_model_path)

    async def main():
        engine = VLLMEngine(tiny_model_path, seed=0, weight_transfer_backend="ipc",
                            gpu_memory_utilization=0.2)
        try:
            return await _check_engine(engine, trainer, tokenizer, VllmIpcTransport())
        finally:
            engine.shutdown()

    before, after = asyncio.run(main())
    assert before < 1e-4 and after < 1e-4


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
    others = {p.pid for p in psutil.Process().children()}  # e.g. the module's shared engine's

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
