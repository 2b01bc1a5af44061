"""The real architectures of test_architectures.py served by vLLM: rollout vs the trainer's
logprobs before and after a weight sync through the default transport
(conf/weight_transfer/ram_file.yaml), multi-turn sessions' prefix breaks, tool calls.

    .venv/bin/pytest tests/test_architectures_vllm.py -s     # prints the figures ([arch] lines)
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlexp.chat.client import SessionStore
from rlexp.chat.render import render_prompt
from rlexp.sample import Sample, SamplingConfig, Status, TokenTrace
from tests.test_architectures import TEMPERATURE, TEMPLATE, _sessions, _tokenizer, check_sessions


@dataclass
class Served:
    name: str
    path: str
    tokenizer: object
    engine: object
    loop: asyncio.AbstractEventLoop

    def run(self, coro):
        return self.loop.run_until_complete(coro)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "qwen3_moe"])
def served(request, arch_paths):
    from rlexp.rollout.vllm_engine import VLLMEngine

    name, path = request.param, arch_paths[request.param]
    loop = asyncio.new_event_loop()  # the engine's: AsyncLLM stays bound to the loop it started in

    async def start():
        return VLLMEngine(path, seed=0, temperature=TEMPERATURE, max_model_len=512, kv_cache_gb=0.25,
                          max_num_seqs=32)

    engine = loop.run_until_complete(start())
    try:
        yield Served(name, path, _tokenizer(path), engine, loop)
    finally:
        async def stop():
            engine.shutdown()

        loop.run_until_complete(stop())
        loop.close()


def _samples(prompts, gens, rewards=None) -> list[Sample]:
    out = []
    for i, (p, g) in enumerate(zip(prompts, gens)):
        trace = TokenTrace()
        trace.append(p, role="prompt")
        trace.append(g.token_ids, role="assistant", generation=g)
        out.append(Sample(group_id=i // 2, prompt=[], answer="", trace=trace, status=Status.COMPLETED,
                          reward=rewards[i] if rewards else 0.0))
    return out


def _max_diff(trainer, prompts, gens) -> float:
    ours = trainer.sample_logprobs(_samples(prompts, gens))
    return max((lp[len(p):] - torch.tensor(g.logprobs)).abs().max().item()
               for p, g, lp in zip(prompts, gens, ours))


def _change(old, new) -> float:
    """The largest logprob change of the same sampled token at the same position (requests
    with the same seed), over the tokens the two generations share as a prefix."""
    out = 0.0
    for a, b in zip(old, new):
        for ta, tb, la, lb in zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs):
            if ta != tb:
                break
            out = max(out, abs(la - lb))
    return out


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_logprobs_match_the_trainer_before_and_after_a_weight_sync(served):
    from rlexp.trainer.controller import TrainController
    from rlexp.weights.ram_file import RamFileTransport

    tok, engine = served.tokenizer, served.engine
    trainer = TrainController(served.path, temperature=TEMPERATURE, total_steps=1, ref_kl_every_n_steps=0,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    questions = ["What is 12+3?", "Name a prime number.", "Say hello in French."]
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in questions for _ in (0, 1)]

    async def rollout():
        return await asyncio.gather(*(engine.generate(p, SamplingConfig(TEMPERATURE, 1.0, 16, seed=7 + i))
                                      for i, p in enumerate(prompts)))

    gens = served.run(rollout())
    assert all(len(g.token_ids) == len(g.logprobs) > 0 and g.version == 0 for g in gens)
    before = _max_diff(trainer, prompts, gens)
    # one GRPO step on these samples (rewards differ within each group: a real gradient)
    metrics = trainer.fit(_samples(prompts, gens, rewards=[1.0, 0.0] * len(questions)), version=0)
    assert metrics["train/skipped_step"] == 0.0
    moved = _max_diff(trainer, prompts, gens)  # the engine still has the old weights
    transport = RamFileTransport()  # conf/weight_transfer/ram_file.yaml, as the loop builds it
    try:
        served.run(transport.transfer(trainer.weights(), engine, 1))
    finally:
        transport.close()
    assert engine.version == 1
    synced = served.run(rollout())
    assert all(g.versions == [1] * len(g.token_ids) for g in synced)
    after = _max_diff(trainer, prompts, synced)
    changed = _change(gens, synced)
    print(f"\n[arch] {served.name}: logprob max |vLLM - trainer| before sync {before:.2e}, after sync "
          f"{after:.2e}; trainer moved by {moved:.2e}, engine logprobs changed by {changed:.2e} "
          "across the sync")
    assert before < 1e-4 and after < 1e-4, (before, after)
    assert moved > 1e-2 and changed > 1e-2  # the step moved the weights, and the sync carried them


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_three_turn_sessions_prefix_breaks(served):
    template = TEMPLATE[served.name]
    reports = served.run(_sessions(served.engine, served.tokenizer, template, n_sessions=4, seed=3))
    rewrites, breaks = sum(r.rewrites for r in reports), sum(r.breaks for r in reports)
    why = sorted({reason for r in reports for reasons in r.reasons for reason in reasons})
    print(f"\n[arch] {served.name} ({template}): 4 three-turn sessions, 8 replies written back: "
          f"{rewrites} rewritten by the template ({why}), {breaks} counted as prefix breaks by rlexp, "
          f"{rewrites - breaks} as forks")
    check_sessions(reports)
    if template in ("qwen2.5", "smollm2"):  # verbatim but for a stop on another end token
        assert all("stopped on" in x for r in reports for reasons in r.reasons for x in reasons)


@pytest.mark.vllm
def test_vllm_in_place_reload_leaves_the_rotary_tables_alone():
    """vLLM's layer-wise reload (what every weight sync runs in the engine's worker) counted the
    rotary embedding's cos/sin table, computed from the config and in no checkpoint, as a weight
    to load and logged "RotaryEmbedding: Failed to load weights" at every sync. The worker
    extension lists it as never loaded; other modules that load nothing are still reported."""
    import logging

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.model_loader.reload import layerwise

    from rlexp.weights.vllm_private import skip_derived_buffers

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary_emb = RotaryEmbedding(64, 64, 128, 10000.0, True, torch.float32)
            self.norm = torch.nn.LayerNorm(8)

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(layerwise.__name__)
    logger.addHandler(handler)
    try:
        with set_current_vllm_config(VllmConfig()):
            model = Model()
        table = model.rotary_emb.cos_sin_cache.clone()
        layerwise.record_metadata_for_reloading(model)
        assert skip_derived_buffers()
        layerwise.initialize_layerwise_reload(model)  # a reload that loads nothing
        layerwise.finalize_layerwise_reload(model, None)
    finally:
        logger.removeHandler(handler)
    assert messages == ["LayerNorm: Failed to load weights"]
    assert torch.equal(model.rotary_emb.cos_sin_cache, table)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("path", ["template", "system_prompt"])
def test_vllm_tool_call_through_the_template_and_the_system_prompt(served, path):
    """A call forced with tool_choice (vLLM's structured output), parsed, answered with a tool
    message, and a second turn that extends the first's tokens: with the family's template
    rendering the specs, and with rlexp writing them into the system prompt (what a template
    without tool support gets; on the served Llama also through SmolLM2's template, `auto`)."""
    import copy

    from rlexp.chat.render import render_chat
    from rlexp.chat.tool_prompt import tools_system_text as tool_prompt_text
    from rlexp.tools.calculator import Calculator

    tokenizers = [(path, served.tokenizer)]
    if path == "system_prompt" and served.name == "llama":
        smol = copy.deepcopy(served.tokenizer)
        smol.chat_template = (Path(__file__).parents[1] / "rlexp/models/templates/smollm2.jinja").read_text()
        tokenizers.append(("auto", smol))
    for tool_prompt, tokenizer in tokenizers:
        store = SessionStore(served.engine, tokenizer, 512, tool_prompt=tool_prompt)
        assert store.tool_prompt == path
        sid = store.open()
        messages: list[dict] = [{"role": "user", "content": "What is 12+34? Use the calculator."}]
        # the calculator's spec, its expression bounded: the forced call's arguments follow the
        # schema, and a random-weight model would fill an unbounded string up to max_tokens
        spec = [copy.deepcopy(Calculator.spec)]
        spec[0]["function"]["parameters"]["properties"]["expression"]["maxLength"] = 24
        room = 512 - len(tokenizer(render_chat(tokenizer, messages, spec, tool_prompt=path),
                                    add_special_tokens=False).input_ids)
        first = served.run(store.chat(sid, {"messages": messages, "tools": spec, "tool_choice": "required",
                                            "max_tokens": room - 16, "seed": 1}))
        msg = first["choices"][0]["message"]
        assert first["choices"][0]["finish_reason"] == "tool_calls", msg
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "calculator"
        prompt_text = tokenizer.decode(first["prompt_token_ids"])
        assert '"calculator"' in prompt_text  # the model saw the spec, on either path
        if path == "system_prompt":
            assert tool_prompt_text(spec) in prompt_text
        else:  # the template's own rendering, with its own tools section
            assert prompt_text == tokenizer.apply_chat_template(messages, tools=spec, tokenize=False,
                                                                add_generation_prompt=True)
        messages += [msg, {"role": "tool", "tool_call_id": call["id"], "name": "calculator", "content": "46"}]
        second = served.run(store.chat(sid, {"messages": messages, "tools": spec, "max_tokens": 8,
                                             "seed": 2}))
        head = first["prompt_token_ids"] + first["choices"][0]["token_ids"]
        extends = second["prompt_token_ids"][: len(head)] == head
        assert "46" in tokenizer.decode(second["prompt_token_ids"][len(first["prompt_token_ids"]):])
        session = store.close(sid)
        end = tokenizer.decode(head[-1:], skip_special_tokens=False)
        print(f"\n[arch] {served.name} tool call via {path} ({tool_prompt}): "
              f"{call['function']['arguments']}, stopped on {end}, prefix breaks {session.prefix_breaks}")
        # A reply that stops on an end token other than the template's end of turn (Qwen's
        # <|endoftext|> vs <|im_end|>) cannot be a prefix of the next rendering: counted, never silent.
        assert session.prefix_breaks == (0 if extends else 1)
        end_of_turn = "<|im_end|>" if "<|im_end|>" in tokenizer.chat_template else "<|eot_id|>"
        if end == end_of_turn:  # the template's own end of turn: the next rendering extends the reply
            assert extends
