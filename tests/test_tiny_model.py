import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlexp.chat.render import render_prompt
from rlexp.models.machine import KERNEL_FLAGS, MachineKind, _cpuinfo, machine_kind
from rlexp.models.tiny import INTEL_AVX512_AMX, build_char_tokenizer, build_tiny_model
from tests.conftest import TINY_KW


def test_char_tokenizer_roundtrip_and_specials():
    tok = build_char_tokenizer()
    text = "12+34=46\nOk, (x) done!"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok.encode("<|im_end|>", add_special_tokens=False)) == ["<|im_end|>"]


def test_chat_template_is_prefix_preserving():
    tok = build_char_tokenizer()
    msgs = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "2"}]
    renders = [tok.apply_chat_template(msgs[:k], tokenize=False) for k in range(1, 5)]
    for shorter, longer in zip(renders, renders[1:]):
        assert longer.startswith(shorter)
    gen = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert renders[1].startswith(gen)


def test_built_model_is_cached_and_loads(tiny_model_path, tokenizer):
    cache = os.path.dirname(tiny_model_path)
    mtime = os.path.getmtime(os.path.join(tiny_model_path, "config.json"))
    assert build_tiny_model(cache, **TINY_KW) == tiny_model_path  # second call: cache hit
    assert os.path.getmtime(os.path.join(tiny_model_path, "config.json")) == mtime
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert model.config.tie_word_embeddings
    assert model.config.hidden_size // model.config.num_attention_heads == 64
    ids = render_prompt(tokenizer, [{"role": "user", "content": "3+4="}])
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")
    out = model(input_ids=torch.tensor([ids])).logits
    assert out.shape == (1, len(ids), model.config.vocab_size)


def test_build_is_deterministic_from_seed(tmp_path):
    kw = TINY_KW | {"warm_start_steps": 3}
    a = build_tiny_model(str(tmp_path / "a"), **kw)
    b = build_tiny_model(str(tmp_path / "b"), **kw)
    sa = AutoModelForCausalLM.from_pretrained(a).state_dict()
    sb = AutoModelForCausalLM.from_pretrained(b).state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


BUILD = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from rlexp.models.tiny import build_tiny_model
print(build_tiny_model(sys.argv[1], **json.loads(sys.argv[2])))
"""


def test_processes_that_want_the_same_model_at_once_build_it_once(tmp_path):
    """Two runs sharing one cache (a sweep's jobs, the suite's workers): one builds, the other
    waits for its build lock and finds the model built."""
    import subprocess
    import sys

    kw = json.dumps(TINY_KW | {"warm_start_steps": 3})
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, str(tmp_path), kw], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1
    logs = "".join(err for _, err in outs)
    assert logs.count("tiny model: built") == 1 and logs.count("tiny model: cached") == 0, logs[-2000:]
    assert [p.name for p in tmp_path.iterdir() if ".tmp" in p.name] == []


def test_bad_head_dim_is_refused(tmp_path):
    with pytest.raises(ValueError, match="head dim"):
        build_tiny_model(str(tmp_path), **(TINY_KW | {"num_heads": 8}))


def test_saved_tokenizer_loads_back_identically(tiny_model_path):
    # AutoTokenizer (and vLLM) load a qwen2 checkpoint's tokenizer as Qwen2Tokenizer; an
    # earlier plain character vocab lost every space and newline on that round trip.
    from transformers import AutoTokenizer

    text = "<|im_start|>user\n12 + 34 = ?<|im_end|>\n<|im_start|>assistant\n46<|im_end|>"
    fresh = build_char_tokenizer()
    loaded = AutoTokenizer.from_pretrained(tiny_model_path)
    assert loaded.encode(text, add_special_tokens=False) == fresh.encode(text, add_special_tokens=False)
    assert loaded.decode(loaded.encode(text, add_special_tokens=False)) == text
    assert loaded.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=False) == \
        fresh.apply_chat_template([{"role": "user", "content": "a b"}], tokenize=False)


def test_tool_warm_start_examples_label_only_the_assistant_replies():
    from rlexp.models.tiny import _conversation, _encode_conversation, tool_call_text

    tok = build_char_tokenizer()
    conversation = _conversation("12+34=", "46", "tool")
    ids, labels = _encode_conversation(tok, conversation)
    assert tok.decode(ids) == tok.apply_chat_template(conversation, tokenize=False).rstrip("\n")
    trained = tok.decode([t for t, lab in zip(ids, labels) if lab != -100])
    assert trained == tool_call_text("12+34=") + "<|im_end|>" + "46<|im_end|>"
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+34"}}</tool_call>'
    assert tool_call_text("12+34=") == call


# sha256 of model.safetensors, as built with the pinned packages, by the machine kind it was made
# on. The random initial weights (0 steps) are the same on both kinds; one warm-start step
# through MKL's sgemm is enough to part them (docs/models-and-data.md, Reproducibility).
AMD_AVX2 = MachineKind("AuthenticAMD", "AVX2", None)
PINNED = {
    0: [(AMD_AVX2, "47239fa8dc9e4fc9c9faa555bd669a65416db37b2cd862453600871a8828f402"),
        (INTEL_AVX512_AMX, "47239fa8dc9e4fc9c9faa555bd669a65416db37b2cd862453600871a8828f402")],
    25: [(AMD_AVX2, "c9fd7b052e8776b14839ebd4f484f069264776bc2c37602de181719a956e8017"),
         (INTEL_AVX512_AMX, "c8f883a6df2a3659d3574fd11180247669857b5022aed0ad857534fa93a82d8a")],
}


@pytest.mark.parametrize("steps", sorted(PINNED))
def test_the_build_gives_the_same_bytes_as_the_reference(steps, tmp_path):
    """Same arguments, machine kind and package versions -> the same weights, bit for bit.
    Fails when a version or the build recipe changes the bytes; skips on a kind with no pin."""
    here = machine_kind()
    pinned = next((sha for kind, sha in PINNED[steps] if kind.holds_on(here)), None)
    if torch.__version__ != "2.13.0+cpu" or pinned is None:
        pytest.skip(f"no pinned build for torch {torch.__version__} on {here} (pinned: "
                    f"{'; '.join(str(kind) for kind, _ in PINNED[steps])})")
    kw = dict(seed=0, hidden_size=128, num_layers=2, num_heads=2, warm_start_steps=steps,
              warm_start_batch_size=64, warm_start_lr=0.001, warm_start_target_accuracy=1.0,
              task_max_operand=99, task_ops="+", task_eval_size=200, task_seed=0)
    path = Path(build_tiny_model(str(tmp_path), **kw))
    info = json.loads((path / "rlexp_build.json").read_text())
    assert info["sha256"] == hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert info["sha256"] == pinned, info


def test_the_machine_kind_reads_the_vendor_and_the_kernel_extensions(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    first = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
    cpuinfo.write_text(first + "\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu\n")
    assert _cpuinfo(cpuinfo) == ("AuthenticAMD", {"fpu", "avx2", "avx512f", "avx512_bf16"})
    assert _cpuinfo(tmp_path / "absent") == ("unknown", set())
    kind = MachineKind("AuthenticAMD", "AVX512", ("avx2", "avx512f", "avx512_vnni", "avx512_bf16"))
    assert str(kind) == "AuthenticAMD AVX512 (avx2+avx512f+avx512_vnni+avx512_bf16)"
    here = machine_kind()
    assert set(here.extensions or ()) <= set(KERNEL_FLAGS)
    assert here.level == torch.backends.cpu.get_cpu_capability()
