"""Whether a LoRA adapter of the unembedding (`lm_head`) reaches vLLM, per architecture
(`VLLMEngine.adapts_unembedding`, read from vLLM's model class). The Tinker server sends a model
that trains the unembedding as an adapter only where it is True (rlexp/tinker/server.py
`served_adapter`) and samples the merged model elsewhere; these tests hold vLLM to both."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rlexp.chat.render import render_prompt
from rlexp.sample import SamplingConfig
from tests.test_architectures import _tokenizer
from tests.test_architectures_vllm import _max_diff

RANK, ALPHA = 8, 16


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def served(request, arch_paths):
    from rlexp.rollout.vllm_engine import VLLMEngine

    loop = asyncio.new_event_loop()  # the engine's: AsyncLLM stays bound to the loop it started in

    async def start():
        return VLLMEngine(arch_paths[request.param], seed=0, temperature=1.0, max_model_len=256,
                          kv_cache_gb=0.25, max_num_seqs=8, max_lora_rank=RANK)

    engine = loop.run_until_complete(start())
    try:
        yield request.param, arch_paths[request.param], engine, loop
    finally:
        async def stop():  # in the engine's loop, as it was started
            engine.shutdown()

        loop.run_until_complete(stop())
        loop.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_an_unembedding_adapter_is_served_where_the_engine_says_so_and_refused_elsewhere(served, tmp_path):
    from rlexp.trainer.controller import TrainController
    from rlexp.trainer.models import LORA_TARGETS
    from rlexp.weights.adapter_file import write_adapter

    name, path, engine, loop = served
    targets = [*LORA_TARGETS, "lm_head"]
    trainer = TrainController(path, temperature=1.0, total_steps=1, ref_kl_every_n_steps=0,
                              optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                              lora={"rank": RANK, "alpha": ALPHA, "target_modules": targets})
    seeded = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every adapter moved off its initialisation (peft's B starts at 0)
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=seeded) * 0.05)
    write_adapter(tmp_path / "adapter", trainer.adapter_weights(), RANK, ALPHA, targets)
    assert engine.adapts_unembedding == (name == "llama")
    if not engine.adapts_unembedding:
        with pytest.raises(Exception, match="expected target modules"):
            loop.run_until_complete(engine.load_adapter("tenant", tmp_path / "adapter"))
        return
    loop.run_until_complete(engine.load_adapter("tenant", tmp_path / "adapter"))
    tok = _tokenizer(path)
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in ("What is 12+3?", "Say hi.")]

    def gap(adapter: str | None) -> float:
        """max |logprob| difference, the trainer's adapted model vs the engine's replies."""
        async def both():
            sampling = [SamplingConfig(1.0, 1.0, 12, seed=i, adapter=adapter) for i in range(len(prompts))]
            return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, sampling)))
        return _max_diff(trainer, prompts, loop.run_until_complete(both()))

    with_adapter, base = gap("tenant"), gap(None)
    assert with_adapter < 1e-4 < 1e-2 < base, (with_adapter, base)  # the adapter, lm_head included
