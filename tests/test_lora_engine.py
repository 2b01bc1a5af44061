"""LoRA end to end on the engine side: after a sync, vLLM serving the merged weights gives
the trainer's logprobs (the adapters are what moved)."""

import asyncio

import pytest
import torch

from rlexp.chat.render import render_prompt
from rlexp.sample import Sample, SamplingConfig, Status, TokenTrace
from rlexp.trainer.controller import TrainController
from rlexp.weights.ram_file import RamFileTransport

TEMPERATURE = 0.7


def _logprob_diff(trainer, prompts, gens) -> float:
    samples = []
    for p, g in zip(prompts, gens):
        trace = TokenTrace()
        trace.append(p, role="prompt")
        trace.append(g.token_ids, role="assistant", generation=g)
        samples.append(Sample(group_id=0, prompt=[], answer="", trace=trace, status=Status.COMPLETED))
    ours = trainer.sample_logprobs(samples)
    return max((lp[len(p):] - torch.tensor(g.logprobs)).abs().max().item()
               for p, g, lp in zip(prompts, gens, ours))


@pytest.mark.vllm
def test_vllm_serves_the_lora_policy_after_a_sync(tiny_model_path, tokenizer):
    from rlexp.rollout.vllm_engine import VLLMEngine

    trainer = TrainController(tiny_model_path, temperature=TEMPERATURE, total_steps=1, ref_kl_every_n_steps=0,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), lora={"rank": 8})
    adapters = [p for p in trainer.model.parameters() if p.requires_grad]
    assert adapters and all(p.ndim == 2 and 8 in p.shape for p in adapters)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": q}]) for q in ("12+3=", "7+25=", "0+0=")]
    sampling = SamplingConfig(temperature=TEMPERATURE, top_p=1.0, max_tokens=12, seed=5)

    async def main():
        engine = VLLMEngine(tiny_model_path, seed=0, max_model_len=256, kv_cache_gb=0.25, max_num_seqs=32)
        transport = RamFileTransport()
        try:
            gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
            before = _logprob_diff(trainer, prompts, gens)  # lora_B starts at 0: the base model
            with torch.no_grad():  # move only the adapters
                for p in adapters:
                    p.add_(torch.randn_like(p) * 0.2)
            stale = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
            moved = _logprob_diff(trainer, prompts, stale)
            await transport.transfer(trainer.weights(), engine, 1)
            gens = await asyncio.gather(*(engine.generate(p, sampling) for p in prompts))
            return before, moved, _logprob_diff(trainer, prompts, gens)
        finally:
            transport.close()
            engine.shutdown()

    before, moved, after = asyncio.run(main())
    print(f"max |logprob diff| trainer vs vLLM: before {before:.2e}, adapters moved {moved:.2e}, "
          f"after the sync {after:.2e}")
    assert moved > 1e-2  # the adapters change the policy: the test can tell them apart
    assert before < 1e-5 and after < 1e-5
