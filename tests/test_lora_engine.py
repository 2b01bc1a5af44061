"""LoRA end to end on the engine side, one engine that serves adapters: after a sync, vLLM
serving the merged weights gives the trainer's logprobs (the adapters are what moved); a push
of the base weights alone, the adapters not merged, stops the next fit (the sync check). The
adapter itself sent (weight_transfer=lora_adapter): vLLM's LoRA serving gives the trainer's
logprobs at every sync, a prompt cached under the last adapter included, and an adapter vLLM
did not reload stops the next fit."""

import asyncio

import pytest
import torch
from vllm.lora.request import LoRARequest

from rlexp.chat.render import render_prompt
from rlexp.errors import SyncMismatch
from rlexp.sample import SamplingConfig
from rlexp.trainer.controller import TrainController
from rlexp.trainer.models import LORA_TARGETS
from rlexp.weights.adapter_file import POLICY, AdapterFileTransport, write_adapter
from rlexp.weights.ram_file import RamFileTransport
from tests import sync_faults
from tests.conftest import vllm_on_thread
from tests.engine_helpers import _as_samples

pytestmark = pytest.mark.vllm
TEMPERATURE = 0.7
RANK = 8


@pytest.fixture(scope="module")
def vllm(tiny_model_path):
    """(engine, run): one engine of the tiny model for the module (conftest.vllm_on_thread)."""
    with vllm_on_thread(tiny_model_path, 600, seed=0, max_model_len=256, kv_cache_gb=0.25,
                        max_num_seqs=32, max_lora_rank=RANK) as engine_run:
        yield engine_run


def _lora_trainer(path: str) -> TrainController:
    return TrainController(path, temperature=TEMPERATURE, total_steps=2, ref_kl_every_n_steps=0,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), lora={"rank": RANK})


def _logprob_diff(trainer, prompts, gens) -> float:
    ours = trainer.sample_logprobs(_as_samples(prompts, gens))
    return max((lp[len(p):] - torch.tensor(g.logprobs)).abs().max().item()
               for p, g, lp in zip(prompts, gens, ours))


def test_vllm_serves_the_lora_policy_after_a_sync(vllm, tiny_model_path, tokenizer):
    engine, run = vllm
    trainer = _lora_trainer(tiny_model_path)
    adapters = [p for p in trainer.model.parameters() if p.requires_grad]
    assert adapters and all(p.ndim == 2 and 8 in p.shape for p in adapters)
    base = [(n, t.clone()) for n, t in trainer.weights()]  # lora_B starts at 0: the base model
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in ("12+3=", "7+25=", "0+0=")]
    sampling = SamplingConfig(temperature=TEMPERATURE, top_p=1.0, max_tokens=12, seed=5)

    async def main():
        transport = RamFileTransport()
        try:
            gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
            before = _logprob_diff(trainer, prompts, gens)
            with torch.no_grad():  # move only the adapters
                for p in adapters:
                    p.add_(torch.randn_like(p) * 0.2)
            stale = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
            moved = _logprob_diff(trainer, prompts, stale)
            await transport.transfer(trainer.weights(), engine, 1)
            gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
            return before, moved, _logprob_diff(trainer, prompts, gens)
        finally:
            await transport.transfer(base, engine, 0)  # the module's engine as found
            transport.close()

    before, moved, after = run(main())
    print(f"max |logprob diff| trainer vs vLLM: before {before:.2e}, adapters moved {moved:.2e}, "
          f"after the sync {after:.2e}")
    assert moved > 1e-2  # the adapters change the policy: the test can tell them apart
    # float32 vLLM vs transformers, the adapters merged: up to 1.1e-5 measured (an Intel Xeon
    # with AMX, 2026-11-29; which requests share an engine step changes the kernels' shapes)
    assert before < 1e-4 and after < 1e-4


def test_a_push_of_the_unmerged_base_weights_stops_the_next_fit(vllm, tiny_model_path, tokenizer):
    """A real LoRA update (only the adapters move), then the base weights pushed without
    them: the engine still serves the base model, the next fit stops with SyncMismatch; with
    the check off it would have trained on."""
    engine, run = vllm
    prompts = sync_faults.history_prompts(tokenizer, ["4+13=", "4+13=", "21+5=", "21+5="])
    out = sync_faults.plant(sync_faults.lora_not_merged, _lora_trainer(tiny_model_path), engine, run, prompts,
                            TEMPERATURE)
    sync_faults.assert_caught("lora_not_merged", out)


def _move(trainer, scale: float = 0.2) -> None:
    """Move only the adapters (lora_B starts at 0: the base model), by random amounts."""
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * scale)


def test_vllm_serves_the_adapter_sent_at_each_sync_and_a_stale_one_stops_the_fit(vllm, tiny_model_path,
                                                                                  tokenizer):
    engine, run = vllm
    trainer = _lora_trainer(tiny_model_path)
    # ~150-token prompts: more than a KV block, so the second sync's requests find the first's
    # blocks in the prefix cache unless the adapter's new directory keys them apart
    prompts = sync_faults.history_prompts(tokenizer, ["4+13=", "4+13=", "21+5=", "21+5="])
    transport = AdapterFileTransport(RANK, 16, LORA_TARGETS)

    def sample():
        async def gather():
            return await asyncio.gather(*(engine.generate(p, SamplingConfig(TEMPERATURE, 1.0, 8, seed=i))
                                          for i, p in enumerate(prompts)))
        return run(gather())

    def batch(gens):  # groups of two with rewards 0 and 1: every sample carries a training signal
        samples = _as_samples(prompts, gens)
        for i, s in enumerate(samples):
            s.group_id, s.reward = i // 2, float(i % 2)
        return samples

    try:
        _move(trainer)
        run(transport.transfer(trainer.adapter_weights(), engine, 1))
        first = sample()
        after_first = _logprob_diff(trainer, prompts, first)
        adapter_bytes = sum(p.numel() * 4 for p in trainer.model.parameters() if p.requires_grad)
        assert transport.bytes_sent == adapter_bytes  # the adapter, not the model
        _move(trainer)
        stale = _logprob_diff(trainer, prompts, first)  # the moved adapter: the test can tell
        run(transport.transfer(trainer.adapter_weights(), engine, 2))
        second = sample()
        after_second = _logprob_diff(trainer, prompts, second)
        healthy = trainer.fit(batch(second), 2)  # the sync check passes a correct adapter sync
        # the fault: new adapter files, but vLLM asked to add an adapter it holds under that id
        # (no load_inplace) keeps serving the old weights, and the version moves on
        _move(trainer)
        run(_add_without_reload(engine, transport, trainer, 3))
        with pytest.raises(SyncMismatch, match="policy version 3 did not land"):
            trainer.fit(batch(sample()), 3)
    finally:
        run(engine.remove_adapter(POLICY))
        run(engine.weights_loaded(0))  # the module's engine as found: the base model
        transport.close()
    print(f"adapter sync: {adapter_bytes} bytes; |logprob diff| trainer vs vLLM after sync 1 "
          f"{after_first:.2e}, adapter moved {stale:.2e}, after sync 2 {after_second:.2e}")
    assert stale > 1e-2
    assert after_first < 1e-4 and after_second < 1e-4  # float32, as the merged weights above
    assert healthy["sync/tokens"] > 0 and healthy["sync/logprob_diff_p99"] < 1e-4


async def _add_without_reload(engine, transport, trainer, version: int) -> None:
    directory = transport.root / f"v{version}"
    write_adapter(directory, trainer.adapter_weights(), RANK, 16, LORA_TARGETS)
    old = engine.adapters.request(POLICY)
    await engine.llm.add_lora(LoRARequest(POLICY, old.lora_int_id, str(directory)))
    await engine.weights_loaded(version)
