"""A second tiny tokenizer, and a random tiny model with it: a teacher whose tokenizer differs
from the tiny student's (rlexp/models/tiny.py), for on-policy distillation across tokenizers
(rlexp/teachers/align.py).

`build_bpe_tokenizer` is a byte-level BPE trained (with the `tokenizers` library) on the
arithmetic task's conversations, in both of the tiny model's formats (a direct answer, and a
calculator tool call). It has the tiny model's special tokens and chat template, but its ids
differ (the 256 byte symbols come first, the special tokens last) and so does its
tokenization: role names, JSON keys and punctuation runs are merged pieces ("assistant",
"calculator", '":'...). Digits stay single tokens: every qwen2 checkpoint's tokenizer loads back
as a Qwen2Tokenizer, whose pre-tokenizer isolates each digit, whatever merges it holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlexp.data import arithmetic
from rlexp.models.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, _byte_level, _random_model, tool_call_text

if TYPE_CHECKING:
    from transformers import Qwen2Tokenizer

MERGES = 160  # how many merges the trainer may learn (it stops earlier when pairs run out)
# Qwen2Tokenizer's pre-tokenizer (transformers' PRETOKENIZE_REGEX): trained with the one it runs with
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def training_text() -> list[str]:
    """The arithmetic task's turns as the chat template renders them between special tokens:
    each role name with its message, for every problem with operands up to 12, answered
    directly and through the calculator tool (its call, the tool's reply, the answer)."""
    lines = []
    for question, answer in arithmetic.all_problems(12, "+-*"):
        lines += [f"user\n{question}", f"assistant\n{answer}", f"assistant\n{tool_call_text(question)}",
                  f"tool\n{answer}", "system\nYou are a helpful assistant."]
    return lines


def build_bpe_tokenizer() -> Qwen2Tokenizer:
    """The byte-level BPE described in the module docstring, as a Qwen2Tokenizer (how
    transformers and vLLM load a qwen2 checkpoint's tokenizer). Deterministic: the trainer's
    ties are broken by the pair itself, so every call learns the same merges."""
    from tokenizers import Regex, Tokenizer, models, trainers
    from tokenizers import pre_tokenizers as pre
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre.Sequence([pre.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
                                      pre.ByteLevel(add_prefix_space=False, use_regex=False)])
    alphabet = [_byte_level(chr(b)) for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=256 + MERGES, min_frequency=2, show_progress=False,
                                  initial_alphabet=alphabet)
    bpe.train_from_iterator(training_text(), trainer)
    model = json.loads(bpe.to_str())["model"]
    # the trainer numbers the alphabet by its sort order; by byte value reads better
    vocab = {sym: b for b, sym in enumerate(alphabet)}
    vocab |= {t: 256 + k for k, t in enumerate(sorted((t for t in model["vocab"] if t not in vocab),
                                                       key=model["vocab"].__getitem__))}
    vocab |= {t: len(vocab) + k for k, t in enumerate(SPECIAL_TOKENS)}
    merges: list[Any] = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                         unk_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_bpe_model(out: Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 2) -> Path:
    """A qwen2 model with random weights (seeded) and `build_bpe_tokenizer`'s tokenizer, saved
    in `out` (float32, both through save_pretrained) for transformers and vLLM to load.
    hidden_size / num_heads must be a head dim vLLM's CPU attention takes (32, 64, ...)."""
    import torch

    tokenizer = build_bpe_tokenizer()
    torch.manual_seed(seed)
    vocab_size = -(-len(tokenizer) // 64) * 64  # every id, rounded up as checkpoints do
    model = _random_model(tokenizer, hidden_size, num_layers, num_heads, vocab_size=vocab_size)
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
