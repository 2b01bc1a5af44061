"""A tiny Qwen2-architecture model with a character-level tokenizer, built locally.

`build_tiny_model` creates (once, cached by its arguments) an HF directory that both
transformers and vLLM load. It then runs a short supervised warm-start on the
arithmetic task format, using only training-split problems (never the held-out ones),
so that RL starts from a policy that is sometimes right; see README "The tiny model".
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import string
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

from rlexp.data import arithmetic
from rlexp.models.machine import MachineKind, machine_kind

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
# Prefix-preserving: rendering messages[:k] is a prefix of rendering messages[:k+1]. It reads
# `tools` only to say it handles them (rlexp/chat/tool_prompt.py): a tiny model learns its tool
# in the warm-start, and a spec in its prompt would not fit its context.
CHAT_TEMPLATE = (
    "{% if tools %}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FORMAT_VERSION = 4  # bump when the build recipe changes, to invalidate caches
INTEL_AVX512_AMX = MachineKind("GenuineIntel", "AVX512", (  # a Xeon with AMX
    "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
    "amx_tile", "amx_bf16", "amx_int8"))
# sha256 of model.safetensors of builds whose runs the docs report, by cache key, with the
# machine kind they were made on (torch 2.13.0+cpu, transformers 5.19.0: the pins). The same
# bytes come back on a machine of that kind; see docs/models-and-data.md, Reproducibility.
REFERENCE_BUILDS: dict[str, list[tuple[MachineKind, str]]] = {
    "db56b6bd5abd": [  # the default model
        (INTEL_AVX512_AMX, "4cb4c04e102fda7541c5cea4125fa163fc0c510716a49d881b2a22ca287a0efd"),
    ],
}


def reference_build(key: str, here: MachineKind) -> str | None:
    """The sha256 the build of cache key `key` has on a machine of kind `here`, where known."""
    return next((sha for kind, sha in REFERENCE_BUILDS.get(key, []) if kind.holds_on(here)), None)


def _byte_level(ch: str) -> str:
    """GPT-2 / Qwen byte-level alphabet: printable bytes map to themselves, others shift."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    b = ord(ch)
    return ch if b in printable else chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def build_char_tokenizer() -> Qwen2Tokenizer:
    """A byte-level BPE with no merges: one token per character.

    It is a Qwen2Tokenizer on purpose: `AutoTokenizer` (and vLLM) load any qwen2-type
    checkpoint's tokenizer as one, so building it this way makes the saved tokenizer load
    back identically everywhere (a plain character vocab silently lost spaces and newlines)."""
    from transformers import Qwen2Tokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab |= {_byte_level(c): len(SPECIAL_TOKENS) + i for i, c in enumerate(CHARS)}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(
    cache_dir: str,
    seed: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    warm_start_steps: int,
    warm_start_batch_size: int,
    warm_start_lr: float,
    warm_start_target_accuracy: float,
    task_max_operand: int,
    task_ops: str,
    task_eval_size: int,
    task_seed: int,
    warm_start_format: str = "answer",
    num_experts: int = 0,
    experts_per_token: int = 2,
) -> str:
    """Return the path of the built model directory, building it on first use.
    `num_experts` > 0: a mixture of experts (Qwen3-MoE's layout, every MLP `num_experts`
    experts of hidden_size, top-`experts_per_token` routing) instead of Qwen2's dense MLP."""
    params = dict(locals())
    if warm_start_format not in ("answer", "tool"):
        raise ValueError(f"model.warm_start_format must be 'answer' or 'tool', got {warm_start_format!r}")
    if hidden_size // num_heads not in (32, 64, 80, 96, 112, 128):
        raise ValueError(
            f"model: hidden_size/num_heads = {hidden_size // num_heads}; vLLM's CPU attention "
            "needs a head dim of 32, 64, 80, 96, 112 or 128"
        )
    if num_experts and not 1 <= experts_per_token <= num_experts:
        raise ValueError(f"model: experts_per_token={experts_per_token} must be in 1..num_experts="
                         f"{num_experts}")
    moe = ("num_experts", "experts_per_token")  # in a dense model's cache key: neither
    args = {k: v for k, v in locals().items() if k != "cache_dir" and (num_experts or k not in moe)
            and k != "moe"} | {"v": FORMAT_VERSION}
    key = hashlib.sha1(json.dumps(args, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(cache_dir).expanduser().resolve() / f"tiny-{key}"
    if (out / "config.json").exists():
        log.info("tiny model: cached at %s", out)
        return str(out)
    with _build_lock(out):  # runs sharing the user's cache (a sweep's jobs) build it once
        if not (out / "config.json").exists():
            _build(out, params, args, key)
    return str(out)


@contextlib.contextmanager
def _build_lock(out: Path) -> Iterator[None]:
    """Held while `out` is built: another process that wants the same model waits for it (the
    kernel drops the lock if the builder dies)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out.with_name(out.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build(out: Path, p: dict, args: dict, key: str) -> None:
    """Train the model `p` (build_tiny_model's arguments) describes and save it as `out`."""
    import torch  # here, not at the top: a cached model is found without importing torch

    t0 = time.time()
    torch.manual_seed(p["seed"])
    tokenizer = build_char_tokenizer()
    model = _random_model(tokenizer, p["hidden_size"], p["num_layers"], p["num_heads"], p["num_experts"],
                          p["experts_per_token"])
    train, _ = arithmetic.split(p["task_max_operand"], p["task_ops"], p["task_eval_size"], p["task_seed"])
    _warm_start(model, tokenizer, train, p["warm_start_steps"], p["warm_start_batch_size"],
                p["warm_start_lr"], p["warm_start_target_accuracy"], p["seed"], p["warm_start_format"])
    _save_atomically(model, tokenizer, out, args, key)
    log.info("tiny model: built %s in %.1fs", out, time.time() - t0)


def _random_model(tokenizer, hidden_size: int, num_layers: int, num_heads: int, num_experts: int = 0,
                  experts_per_token: int = 2, vocab_size: int = 128):
    import transformers

    moe = {"num_experts": num_experts, "num_experts_per_tok": experts_per_token, "decoder_sparse_step": 1,
           "moe_intermediate_size": hidden_size, "norm_topk_prob": True, "mlp_only_layers": [],
           "head_dim": hidden_size // num_heads, "attention_bias": False} if num_experts else {}
    config = getattr(transformers, "Qwen3MoeConfig" if num_experts else "Qwen2Config")(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=cast(int, tokenizer.convert_tokens_to_ids("<|im_start|>")),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **moe,
    )
    return (transformers.Qwen3MoeForCausalLM if num_experts else transformers.Qwen2ForCausalLM)(config)


def _save_atomically(model, tokenizer, out: Path, args: dict, key: str) -> None:
    """Written beside `out`, then renamed: a crashed build never leaves a half-written cache
    entry. Warns when the weights differ from the reference build of this configuration."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    digest = hashlib.sha256((tmp / "model.safetensors").read_bytes()).hexdigest()
    made_with = build_environment()
    (tmp / "rlexp_build.json").write_text(json.dumps(args | made_with | {"sha256": digest}, indent=2))
    reference = reference_build(key, machine_kind())
    if reference is not None and digest != reference:
        log.warning("tiny model: these weights differ from the reference build made on this machine kind "
                    "(%s), so runs will not reproduce the docs' figures exactly (docs: Reproducibility)",
                    ", ".join(f"{k} {v}" for k, v in made_with.items()))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def build_environment() -> dict[str, str]:
    """What a build's bytes depend on besides its arguments: the library versions and the machine
    kind (rlexp/models/machine.py: vendor, CPU level, kernel extensions)."""
    import tokenizers
    import torch
    import transformers

    kind = machine_kind()
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "cpu_vendor": kind.vendor, "cpu_capability": kind.level,
            "cpu_extensions": "+".join(kind.extensions or ())}


def tool_call_text(question: str) -> str:
    expression = question.rstrip("=")
    return ('<tool_call>{"name": "calculator", "arguments": {"expression": "' + expression
            + '"}}</tool_call>')


def _conversation(question: str, answer: str, fmt: str) -> list[dict[str, str]]:
    """The warm-start example for one problem: answer directly, or call the calculator
    tool, read its result, then answer."""
    user = {"role": "user", "content": question}
    if fmt == "answer":
        return [user, {"role": "assistant", "content": answer}]
    return [user, {"role": "assistant", "content": tool_call_text(question)},
            {"role": "tool", "content": answer}, {"role": "assistant", "content": answer}]


def _encode_conversation(tokenizer, messages) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and labels on the assistant replies only (built
    turn by turn, as rollouts are: prompt renderings extended by suffixes)."""
    ids: list[int] = []
    labels: list[int] = []
    text = ""
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=True, tokenize=False)
        new = tokenizer.encode(prompt[len(text):], add_special_tokens=False)
        reply = tokenizer.encode(m["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
        ids += new + reply
        labels += [-100] * len(new) + reply
        text = prompt + m["content"] + "<|im_end|>"
    return ids, labels


def _warm_start(model, tokenizer, problems, steps, batch_size, lr, target_accuracy, seed,
                fmt: str = "answer") -> None:
    """Supervised next-token training on task conversations (`_conversation`), loss on the
    assistant replies, for at most `steps` steps, stopping early once greedy decoding gets
    the first reply exactly right for `target_accuracy` of a fixed probe of 256 *training*
    problems (checked every 25 steps)."""
    import torch

    if steps <= 0:
        return
    rng = random.Random(seed)
    first_reply = (lambda q, a: a) if fmt == "answer" else (lambda q, a: tool_call_text(q))
    probe = [(q, first_reply(q, a)) for q, a in problems[:256]]
    max_new = 6 if fmt == "answer" else 96
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    warmup = max(1, min(50, steps // 5))
    for step in range(1, steps + 1):
        for group in opt.param_groups:  # linear warm-up: a constant high lr from step 1 diverges
            group["lr"] = lr * min(1.0, step / warmup)
        rows, labels = zip(*(_encode_conversation(tokenizer, _conversation(q, a, fmt))
                             for q, a in rng.choices(problems, k=batch_size)))
        width = max(map(len, rows))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=lab).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 and target_accuracy < 1.0:
            accuracy = greedy_accuracy(model, tokenizer, probe, max_new)
            model.train()
            log.info("tiny model: warm-start step %d, probe accuracy %.3f", step, accuracy)
            if accuracy >= target_accuracy:
                break
    model.eval()


def greedy_accuracy(model, tokenizer, problems, max_new_tokens: int = 6) -> float:
    import torch

    model.eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=False)
               for q, _ in problems]
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    tokenizer.padding_side = side
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    return sum(t.strip() == a for t, (_, a) in zip(texts, problems)) / len(problems)
