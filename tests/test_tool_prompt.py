"""Tool specs for templates that ignore `tools`: the system-prompt path (scripted engine, real
tokenizer and real chat templates). The same through real vLLM on real architectures is in
tests/test_architectures_vllm.py."""

import asyncio
import copy
import json

import pytest

from rlexp.agents.tool import ToolAgent
from rlexp.chat import tool_prompt
from rlexp.chat.client import SessionStore
from rlexp.judges.math_exact import MathExactJudge
from rlexp.sample import Sample
from tests.fakes import ScriptedEngine

# SmolLM2-135M-Instruct's template (ChatML with a default system prompt); it never reads `tools`.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
           "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
           "{% endif %}")
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>'


@pytest.fixture
def smol_tokenizer(tokenizer):
    """The tiny model's character tokenizer with SmolLM2's chat template."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = SMOLLM2
    return tok


def _task():
    return Sample(group_id=0, prompt=[{"role": "user", "content": "12+34="}], answer="46",
                  metadata={"seed": 1})


def test_auto_picks_the_path_from_the_template(tokenizer, smol_tokenizer):
    assert tool_prompt.resolve(smol_tokenizer, "auto") == "system_prompt"
    assert tool_prompt.resolve(tokenizer, "auto") == "template"  # the tiny template reads `tools`
    assert tool_prompt.resolve(smol_tokenizer, "template") == "template"


def test_messages_are_rewritten_into_roles_every_template_knows():
    spec = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "go"},
                {"role": "assistant", "content": "", "tool_calls": [call, call]},
                {"role": "tool", "tool_call_id": "c1", "content": "1"},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    out = tool_prompt.with_tools_in_system(messages, [spec])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(spec) in out[0]["content"]
    block = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert out[2]["content"] == block + "\n" + block
    assert out[3]["content"] == "<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>"
    assert messages[0]["content"] == "Be brief." and "tool_calls" in messages[2]  # input untouched
    no_system = tool_prompt.with_tools_in_system(messages[1:2], [spec])
    assert no_system[0]["role"] == "system" and no_system[0]["content"].startswith("# Tools")


def test_tool_agent_on_a_template_without_tools(smol_tokenizer):
    engine = ScriptedEngine(smol_tokenizer, [CALL, "46"], max_model_len=2048)
    agent = ToolAgent(engine, smol_tokenizer, MathExactJudge())
    assert agent.store.tool_prompt == "system_prompt"
    (s,) = asyncio.run(agent.rollout(_task()))
    (p1, g1), (p2, g2) = engine.calls
    first = smol_tokenizer.decode(p1)
    assert first.startswith("<|im_start|>system\n# Tools\n") and '"name": "calculator"' in first
    assert '"name": "python"' in first and "<|im_start|>user\n12+34=<|im_end|>" in first
    # the call was parsed and run, its result came back as a user <tool_response>, and the
    # second prompt extends the first exactly: one training sample, no prefix break
    assert s.metadata["metrics"]["tool/calls_mean"] == 1.0 and s.metadata["metrics"]["tool/errors"] == 0.0
    assert p2[: len(p1) + len(g1)] == p1 + g1 and s.tokens == p2 + g2
    assert s.metadata["prefix_breaks"] == 0
    assert smol_tokenizer.decode(p2[len(p1) + len(g1):]).startswith(
        "\n<|im_start|>user\n<tool_response>\n46\n</tool_response><|im_end|>")
    assert s.reward == 1.0


def test_template_path_leaves_the_prompt_to_the_template(smol_tokenizer):
    """Forcing `template` on a template that ignores tools: the model never sees the specs
    (why such templates get the specs through the system prompt by default)."""
    engine = ScriptedEngine(smol_tokenizer, ["46"], max_model_len=2048)
    asyncio.run(ToolAgent(engine, smol_tokenizer, MathExactJudge(), tool_prompt="template").rollout(_task()))
    assert "calculator" not in smol_tokenizer.decode(engine.calls[0][0])


def test_a_chat_request_with_tools_gets_them_in_the_system_prompt(smol_tokenizer):
    store = SessionStore(ScriptedEngine(smol_tokenizer, [], max_model_len=2048), smol_tokenizer, 2048)
    spec = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    sid = store.open()
    asyncio.run(store.chat(sid, {"messages": [{"role": "user", "content": "hi"}], "tools": [spec]}))
    prompt = store.get(sid).branches[0].trace.tokens
    assert "# Tools" in smol_tokenizer.decode(prompt)


def test_prompt_lengths_are_checked_with_the_tool_specs(tiny_model_path, smol_tokenizer):
    """Preflight counts a tool agent's prompts as they will be sent: on the system-prompt path
    the specs (~900 characters) do not fit the tiny context; on the template path they do."""
    from rlexp.errors import ConfigError
    from rlexp.preflight import check_lengths, load_inputs
    from tests.test_config import _compose

    cfg = _compose(["agent=tool", "model=local", f"model.path={tiny_model_path}", "rollout.max_model_len=256",
                    "rollout.max_response_tokens=8"])
    inputs = load_inputs(cfg)
    check_lengths(cfg, inputs, smol_tokenizer.__class__.from_pretrained(tiny_model_path))  # template path
    with pytest.raises(ConfigError, match="do not fit in rollout.max_model_len=256"):
        check_lengths(cfg, inputs, smol_tokenizer)
