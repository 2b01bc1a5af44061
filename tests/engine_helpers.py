"""The engine tests' helpers: the check every rollout engine passes against the trainer (the
same tokens' logprobs before and after a weight sync: `_check_engine`), and a vLLM engine of
the tiny model that leaves nothing behind when shut down (`_run_vllm`: its directory, shared
memory and processes gone). Used by tests/test_engines.py, test_engines_interrupted.py,
test_cluster.py and test_ray_gpu.py."""

import asyncio
import os

import psutil
import torch

from rlexp.chat.render import render_prompt
from rlexp.sample import Sample, SamplingConfig, Status, TokenTrace
from rlexp.trainer.controller import TrainController
from rlexp.weights.ram_file import RamFileTransport

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


def _record_n(engine) -> list[int]:
    """The `n` of every request the engine sends to vLLM from now on."""
    generate, sent = engine.llm.generate, []

    def recorded(prompt, params, *args, **kwargs):
        sent.append(params.n)
        return generate(prompt, params, *args, **kwargs)

    engine.llm.generate = recorded
    return sent
