"""Real architectures (rlexp/models/arch.py: Llama, Qwen2, Qwen3 with random weights, trained
BPE tokenizers and the published chat templates) through the code paths of a `model=local`
run without an engine: tokenizers, templates, transformers loading, multi-turn sessions with
scripted replies. Through vLLM: test_architectures_vllm.py."""

from __future__ import annotations

import asyncio
import json
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rlexp.chat.client import SessionStore
from rlexp.chat.render import render_prompt
from rlexp.models.arch import FAMILIES, LAYOUTS, build_arch_model
from rlexp.sample import Generation, SamplingConfig
from tests.fakes import ScriptedEngine

# name -> build_arch_model arguments; "smollm2" is SmolLM2's layout: a Llama with its template
# and tokenizer, tied embeddings
BUILDS: dict[str, dict] = {
    "llama": {"family": "llama"}, "qwen2": {"family": "qwen2"}, "qwen3": {"family": "qwen3"},
    "smollm2": {"family": "llama", "chat_template": "smollm2", "tie_word_embeddings": True},
    "qwen3_moe": {"family": "qwen3_moe"}}
TEMPLATE = {name: kw.get("chat_template") or FAMILIES[kw["family"]].template for name, kw in BUILDS.items()}
TEMPERATURE = 0.7


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)  # as the loop loads it


# ---- fast: tokenizers, templates, models --------------------------------------------------

TEXTS = [
    "Hello, world!\n\n  indented\ttab\r\nCRLF line  trailing spaces  ",
    " leading space and\nnew lines\n\n\n",
    "12345+678=13023; 3.14159 * 2 = 6.28318",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
    "Café naïve façade — “quotes” … Zürich; Русский; 日本語; 中文; 한국어; العربية; 🙂🚀; ∑√π≤∞",
    "\u00a0non-breaking\u2009thin\u200bzero-width; control \x00\x01\x7f chars",
    "x" * 300,
]


@pytest.mark.parametrize("name", BUILDS)
def test_tokenizer_round_trips_text_and_has_the_family_layout(arch_paths, name):
    tok = _tokenizer(arch_paths[name])
    layout = LAYOUTS[TEMPLATE[name]]
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    # a trained BPE, not one token per byte
    assert len(tok.encode("The answer is 42. Return the value.", add_special_tokens=False)) <= 12
    # Qwen's tokenizer normalises to NFC (as the published one does); the others keep any text
    decomposed = "e\u0301t\u00e9"
    back = tok.decode(tok.encode(decomposed, add_special_tokens=False))
    assert back == (unicodedata.normalize("NFC", decomposed) if layout.nfc else decomposed)
    # special tokens: the published strings, order and place (after the BPE vocabulary, or first)
    first = tok.convert_tokens_to_ids(layout.specials[0])
    assert first == (0 if layout.specials_first else len(tok) - len(layout.specials) - len(layout.plain))
    n = len(layout.specials)
    assert [tok.convert_tokens_to_ids(t) for t in layout.specials] == [*range(first, first + n)]
    assert tok.eos_token == layout.eos and tok.bos_token == layout.bos and tok.pad_token == layout.pad
    text = f"a{layout.eos}b" + "".join(layout.plain[:2])
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert len(tok.encode(layout.eos, add_special_tokens=False)) == 1
    # non-special added tokens (Qwen's <tool_call>, <think>) survive skip_special_tokens
    assert tok.decode(tok.encode(f"{layout.eos}x", add_special_tokens=False), skip_special_tokens=True) == "x"
    for plain in layout.plain:
        assert tok.decode(tok.encode(plain, add_special_tokens=False), skip_special_tokens=True) == plain
    # Llama 3 adds <|begin_of_text|> when special tokens are added; the others add nothing
    bos = [tok.bos_token_id] if layout.add_bos else []
    assert tok.encode("hi") == bos + tok.encode("hi", add_special_tokens=False)
    # the published pre-tokenizers: Llama 3 cuts digits in threes, Qwen2 one by one, SmolLM2 not
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x 1234567")]
    assert pieces == {"llama3": ["x", "Ġ", "123", "456", "7"], "qwen2": ["x", "Ġ", *"1234567"],
                      "gpt2": ["x", "Ġ1234567"]}[layout.pre_tokenizer]


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"}]
RENDERED = {
    "llama3.1": "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
                "December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|><|start_header_id|>user"
                "<|end_header_id|>\n\nWhat is 2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
                "4<|eot_id|>",
    "qwen2.5": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
               "<|im_start|>assistant\n4<|im_end|>\n",
    # the last assistant turn after the last user query gets an (empty) think block
    "qwen3": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
             "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n",
    "smollm2": "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
               "<|im_start|>assistant\n4<|im_end|>\n",
}
GENERATION_PROMPT = {"llama3.1": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                     "qwen2.5": "<|im_start|>assistant\n", "qwen3": "<|im_start|>assistant\n",
                     "smollm2": "<|im_start|>assistant\n"}
DEFAULT_SYSTEM = {"llama3.1": "Cutting Knowledge Date: December 2023",
                  "qwen2.5": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
                  "qwen3": None,
                  "smollm2": "You are a helpful AI assistant named SmolLM, trained by Hugging Face"}
TOOL = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}


@pytest.mark.parametrize("name", BUILDS)
def test_template_renders_the_family_markers(arch_paths, name):
    tok = _tokenizer(arch_paths[name])
    template = TEMPLATE[name]
    assert tok.apply_chat_template(CHAT, tokenize=False) == RENDERED[template]
    user = CHAT[1:2]
    prompt = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("What is 2+2?" + ("<|eot_id|>" if template == "llama3.1" else "<|im_end|>\n")
                           + GENERATION_PROMPT[template])
    if DEFAULT_SYSTEM[template]:
        assert DEFAULT_SYSTEM[template] in prompt
    else:
        assert prompt.startswith("<|im_start|>user\n")
    with_tools = tok.apply_chat_template(user, tools=[TOOL], tokenize=False, add_generation_prompt=True)
    if template == "smollm2":  # SmolLM2's template ignores tools
        assert with_tools == prompt
    else:
        assert '"name": "calculator"' in with_tools and "calculator" not in prompt
        if template != "llama3.1":  # Hermes-style calls
            assert "<tool_call>" in with_tools
    # preflight renders prompts without transformers (to check their lengths): the same text
    from rlexp.preflight import LightTokenizer

    light = LightTokenizer.load(arch_paths[name])
    assert light is not None
    assert light.apply_chat_template(user, add_generation_prompt=True) == prompt
    assert light.apply_chat_template(user, add_generation_prompt=True, tools=[TOOL]) == with_tools
    assert light.apply_chat_template(CHAT, add_generation_prompt=False) == RENDERED[template]


@pytest.mark.parametrize("name", BUILDS)
def test_model_is_the_family_architecture_and_loads_in_transformers(arch_paths, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = arch_paths[name]
    family = FAMILIES[BUILDS[name]["family"]]
    config = AutoConfig.from_pretrained(path)
    assert type(config).__name__ == family.config_class
    assert config.head_dim in (32, 64, 80, 96, 112, 128)
    assert config.tie_word_embeddings == BUILDS[name].get("tie_word_embeddings", family.tie_word_embeddings)
    tok = _tokenizer(path)
    assert config.vocab_size >= len(tok) and config.vocab_size % 64 == 0
    layout = LAYOUTS[TEMPLATE[name]]
    gen = json.loads(Path(path, "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids(t) for t in layout.stop]
    model = AutoModelForCausalLM.from_pretrained(path)
    names = set(model.state_dict())
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (name in ("qwen3", "qwen3_moe"))
    assert ("model.layers.0.mlp.gate.weight" in names) == (name == "qwen3_moe")  # the router
    if name == "qwen3_moe":
        assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (name == "qwen2")
    ids = torch.tensor([render_prompt(tok, CHAT[1:2])])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], config.vocab_size)
    # cached by its arguments: the same call returns the same directory without building
    assert build_arch_model(cache_dir=str(Path(path).parent), seed=0, **BUILDS[name]) == path


def test_a_build_is_reproducible(arch_paths, tmp_path):
    again = build_arch_model("qwen2", str(tmp_path), seed=0)
    for f in ("model.safetensors", "tokenizer.json", "config.json", "chat_template.jinja"):
        assert Path(again, f).read_bytes() == Path(arch_paths["qwen2"], f).read_bytes(), f


# ---- prefix preservation ---------------------------------------------------------------------


def break_reasons(tokenizer, template: str, gen: Generation) -> list[str]:
    """Why writing this reply back into the template as history does not reproduce the text it
    was generated as (a prefix break at the next turn); empty if it does."""
    ids = gen.token_ids
    stopped = gen.finish_reason == "stop" and bool(ids) and ids[-1] in tokenizer.all_special_ids
    raw = tokenizer.decode(ids[:-1] if stopped else ids, skip_special_tokens=False)
    reasons = []
    end = LAYOUTS[template].eos  # what the template closes an assistant turn with
    if stopped and tokenizer.convert_ids_to_tokens(ids[-1]) != end:
        reasons.append(f"stopped on {tokenizer.convert_ids_to_tokens(ids[-1])}, re-rendered as {end}")
    if template == "llama3.1" and raw != raw.strip():
        reasons.append("Llama 3.1 trims assistant content")
    if template == "qwen3" and "</think>" in raw:
        reasons.append("Qwen3 drops <think>...</think> from earlier turns")
    return reasons


class _Recorder:
    """The engine, recording every generation (the session sees the engine unchanged)."""

    def __init__(self, engine):
        self.engine, self.gens = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def generate(self, token_ids, sampling, images=None):
        gen = await self.engine.generate(token_ids, sampling)
        self.gens.append(gen)
        return gen


@dataclass
class SessionReport:
    """One recorded chat: rlexp's prefix-break count, its training samples (leaves), and why
    each reply written back into a later prompt is rewritten by the template (empty: it is not)."""

    breaks: int
    leaves: int
    reasons: list[list[str]]
    replies: list[tuple[str, str]]  # (text with special tokens, finish reason)

    @property
    def rewrites(self) -> int:
        return sum(map(bool, self.reasons))


async def _sessions(engine, tokenizer, template: str, n_sessions: int, turns: int = 3, seed: int = 0,
                    max_tokens: int = 12) -> list[SessionReport]:
    """`n_sessions` chats of `turns` turns (answer, "Try again.", ...) through rlexp's session
    store (the OpenAI-shaped client the agents use)."""
    recorder = _Recorder(engine)
    store = SessionStore(recorder, tokenizer, max_context=512)
    out = []
    for s in range(n_sessions):
        messages = [{"role": "user", "content": f"What is {s + 12}+{s + 30}?"}]
        async with store.record(SamplingConfig(1.0, 1.0, max_tokens, seed + s)) as rec:
            for turn in range(turns):
                reply = await rec.client.chat.completions.create(messages=messages,
                                                                 seed=seed + 100 * s + turn)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": "Try again."}]
        session = rec.session
        assert session is not None and session.calls == turns
        gens = recorder.gens[-turns:]
        out.append(SessionReport(
            session.prefix_breaks, len(session.leaves()),
            [break_reasons(tokenizer, template, g) for g in gens[:-1]],  # the last is never written back
            [(tokenizer.decode(g.token_ids, skip_special_tokens=False), g.finish_reason) for g in gens]))
    return out


def check_sessions(reports: list[SessionReport]) -> None:
    """What a template that rewrites a reply does to a session: the reply's branch is not
    continued, so it ends up as a training sample of its own (one extra leaf per rewritten
    reply). rlexp counts that as a prefix break only when no earlier branch of the session
    matches the new rendering; when one does (the rewritten reply is not the first), the
    session forks from it instead and `prefix_breaks` does not count it."""
    for r in reports:
        assert r.leaves - 1 == r.rewrites, r
        assert r.breaks <= r.rewrites, r
        first_rewritten = bool(r.reasons[0])
        assert r.breaks >= first_rewritten, r


SCRIPTS = {  # replies; the template-rewritten one is first (a counted break) or second (a fork)
    "first": [" <think>a</think>4", "5", "6"],
    "second": ["4", " <think>a</think>5", "6"],
}
REWRITES = {"llama3.1": 1, "qwen2.5": 0, "qwen3": 1, "smollm2": 0}  # a leading space, a think block


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("name", BUILDS)
def test_prefix_breaks_of_the_real_templates_with_scripted_replies(arch_paths, name, script):
    """Qwen2.5's and SmolLM2's templates write earlier replies back verbatim; Llama 3.1's trims
    them and Qwen3's drops their <think> blocks."""
    tok = _tokenizer(arch_paths[name])
    template = TEMPLATE[name]
    (report,) = asyncio.run(_sessions(ScriptedEngine(tok, list(SCRIPTS[script])), tok, template, 1))
    assert report.rewrites == REWRITES[template], report
    check_sessions([report])
    assert report.breaks == (report.rewrites if script == "first" else 0), report


# ---- vLLM: one engine per architecture --------------------------------------------------------
