"""Rollout engines against the trainer: same tokens, same sampling-distribution logprobs,
before and after a weight update; a group's requests as one; a faulty weight sync caught.
Requests cut short (a pause for new weights, a dead engine process):
tests/test_engines_interrupted.py."""

import asyncio
from types import SimpleNamespace

import psutil
import pytest

from rlexp.rollout.vllm_engine import cache_salt
from rlexp.rollout.vllm_sampling import sampling_params
from rlexp.sample import SamplingConfig
from rlexp.weights.files import save_safetensors
from tests import sync_faults
from tests.conftest import vllm_on_thread
from tests.engine_helpers import (
    ENGINE_KW,
    TEMPERATURE,
    _check_engine,
    _engine_processes,
    _left_nothing,
    _owned_files,
    _prompts,
    _record_n,
    _trainer,
)


def test_hf_engine_logprobs_match_trainer(tiny_model_path, tokenizer):
    from rlexp.rollout.hf_engine import HFEngine

    engine = HFEngine(tiny_model_path, seed=0)
    before, after = asyncio.run(_check_engine(engine, _trainer(tiny_model_path), tokenizer))
    assert before < 1e-4 and after < 1e-4
    heard: list[tuple[list[int], list[float]]] = []  # streamed: the whole reply, once
    gen = asyncio.run(engine.generate_streaming([1, 2, 3], engine.sampling, lambda *new: heard.append(new)))
    assert heard == [(gen.token_ids, gen.logprobs)] and gen.token_ids


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
            together = await engine.generate_group(prompt, [sampling(100 + i) for i in range(6)])
            spread = await engine.generate_group(prompt, [sampling(100 + 2 * i) for i in range(3)])
        finally:
            del engine.llm.generate  # the instance attribute: vLLM's method again
        return sent, grouped, alone, apart, together, spread

    sent, grouped, alone, apart, together, spread = tiny_vllm.run(check())
    assert sent == [6] + [1] * 6 + [1] * 3 + [6] + [1] * 3
    assert together == grouped and spread == apart  # a group in one coroutine: the same replies
    assert [g.token_ids for g in grouped] == [g.token_ids for g in alone]
    assert len({tuple(g.token_ids) for g in alone}) > 1  # the seeds differ: so do the samples
    assert [g.finish_reason for g in grouped] == [g.finish_reason for g in alone]
    diff = max(abs(a - b) for g, s in zip(grouped, alone) for a, b in zip(g.logprobs, s.logprobs))
    assert diff < 1e-5 and all(g.versions == [0] * len(g.token_ids) for g in grouped)
    assert [g.token_ids for g in apart] == [alone[0].token_ids, alone[2].token_ids, alone[4].token_ids]


@pytest.mark.vllm
def test_replies_read_from_flat_logprobs_are_vllms_per_token_logprobs(tiny_vllm, tokenizer):
    """rlexp asks vLLM for flat lists of logprobs; read back, they are what vLLM's per-token
    dicts hold: the sampled token's logprob and the top alternatives with theirs."""
    engine, prompt = tiny_vllm.engine, _prompts(tokenizer)[0]
    sampling = SamplingConfig(temperature=1.0, max_tokens=10, seed=7, top_logprobs=3, ignore_eos=True)

    async def check():
        ours = await engine.generate(prompt, sampling)
        params = sampling_params(sampling)
        params.flat_logprobs = False
        request = {"prompt_token_ids": prompt, "cache_salt": cache_salt(engine.version)}
        async for out in engine.llm.generate(request, params, request_id="as-dicts"):
            final = out
        return ours, final.outputs[0]

    ours, dicts = tiny_vllm.run(check())
    assert ours.token_ids == list(dicts.token_ids) and len(ours.token_ids) == 10
    assert ours.logprobs == [step[t].logprob for t, step in zip(dicts.token_ids, dicts.logprobs)]
    assert ours.top_logprobs == [{t: lp.logprob for t, lp in step.items() if lp.rank <= 3}
                                 for step in dicts.logprobs]
    assert all(len(top) >= 3 for top in ours.top_logprobs)


@pytest.mark.vllm
@pytest.mark.parametrize("fault", [sync_faults.lm_head_left_out, sync_faults.kv_reused,
                                   sync_faults.nothing_sent, sync_faults.rounded_to_bfloat16],
                         ids=lambda f: f.__name__)
def test_a_faulty_weight_sync_stops_the_next_fit(tiny_vllm, tiny_model_path, tokenizer, fault):
    """A real update, then a push that returns success but leaves the engine serving other
    numbers (tests/sync_faults.py: a tied lm_head left out, the old weights' KV reused after
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
