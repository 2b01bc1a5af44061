"""Small random-weight models of real architectures, with real tokenizers' layout and chat templates.

`build_arch_model("llama" | "qwen2" | "qwen3", cache_dir, seed)` builds (once, cached by its
arguments like rlexp/models/tiny.py) a Hugging Face directory that transformers and vLLM both
load: the family's own transformers config class at a small size, random weights, and

- a byte-level BPE tokenizer trained here with the `tokenizers` library on a corpus generated
  here (arithmetic and word problems, Python's own docstrings, a few lines of non-English
  text), laid out like the family's published tokenizer: its pre-tokenizer split pattern, its
  special tokens (same strings, same order, after the BPE vocabulary as in the real ones, or
  before it for SmolLM2), its bos/eos/pad; it round-trips any text exactly (Qwen's normalises
  to NFC first, as the real one does);
- a published chat template, verbatim, from rlexp/models/templates/: the family's own by
  default, or another one (`chat_template="smollm2"` on `family="llama"` is SmolLM2's layout).
  They are the `chat_template` of meta-llama/Llama-3.1-8B-Instruct (llama3.1),
  Qwen/Qwen2.5-7B-Instruct (qwen2.5), Qwen/Qwen3-0.6B (qwen3) and
  HuggingFaceTB/SmolLM2-135M-Instruct (smollm2, which ignores `tools`).

Nothing is downloaded. The third family is Qwen3: vLLM's CPU backend runs it, and it differs
from Qwen2 where it matters to rlexp: per-head RMSNorm on q and k (weights the trainer updates
and the weight sync must carry), an explicit head_dim, no qkv bias, and a chat template that
rewrites earlier assistant turns (`<think>` blocks), i.e. a real non-prefix-preserving one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlexp.models.tokenizer_corpus import corpus

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the build recipe changes, to invalidate caches
TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
HEAD_DIMS = (32, 64, 80, 96, 112, 128)  # what vLLM's CPU attention supports

# The published tokenizers' pre-tokenizer split patterns (Llama 3 groups digits by up to
# three, Qwen2 splits every digit).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class TokenizerLayout:
    """What a published tokenizer looks like, minus its learned merges."""

    specials: tuple[str, ...]  # special=True added tokens, in the published order
    plain: tuple[str, ...] = ()  # added tokens that are not special (kept by skip_special_tokens)
    specials_first: bool = False  # SmolLM2's specials take ids 0..n; Llama's and Qwen's follow the BPE vocab
    pre_tokenizer: str = "qwen2"  # "llama3", "qwen2" (their split patterns) or "gpt2" (ByteLevel's own)
    nfc: bool = False  # Qwen's normalizer
    bos: str | None = None
    eos: str = ""
    pad: str | None = None
    unk: str | None = None
    add_bos: bool = False  # Llama 3's post-processor prepends bos when special tokens are added
    stop: tuple[str, ...] = ()  # generation_config.json eos_token_id (vLLM stops on each)
    config_bos: str | None = None  # config.json bos_token_id where it differs from the tokenizer's
    config_stops: bool = False  # config.json eos_token_id is the whole `stop` list (Llama 3.1), else `eos`


_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
_QWEN25_PLAIN = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                 "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")

# By template name (rlexp/models/templates/<name>.jinja): the tokenizer that template goes with.
LAYOUTS: dict[str, TokenizerLayout] = {
    "llama3.1": TokenizerLayout(  # Llama 3.1 Instruct: 256 specials at ids 128000..128255
        specials=("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                  "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                  *(f"<|reserved_special_token_{i}|>" for i in range(3, 248))),
        pre_tokenizer="llama3", bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>",
        add_bos=True, stop=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"), config_stops=True),
    "qwen2.5": TokenizerLayout(  # Qwen2.5 Instruct: ids 151643..151664
        specials=_QWEN_SPECIALS, plain=_QWEN25_PLAIN, nfc=True, eos="<|im_end|>", pad="<|endoftext|>",
        stop=("<|im_end|>", "<|endoftext|>"), config_bos="<|endoftext|>"),
    "qwen3": TokenizerLayout(  # Qwen3: Qwen2.5's, then the tool-response and thinking tags
        specials=_QWEN_SPECIALS,
        plain=(*_QWEN25_PLAIN, "<tool_response>", "</tool_response>", "<think>", "</think>"),
        nfc=True, eos="<|im_end|>", pad="<|endoftext|>", stop=("<|im_end|>", "<|endoftext|>"),
        config_bos="<|endoftext|>"),
    "smollm2": TokenizerLayout(  # SmolLM2 Instruct: ids 0..16
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>",
                  "<filename>", "<gh_stars>", "<issue_start>", "<issue_comment>", "<issue_closed>",
                  "<jupyter_start>", "<jupyter_text>", "<jupyter_code>", "<jupyter_output>",
                  "<jupyter_script>", "<empty_output>"),
        specials_first=True, pre_tokenizer="gpt2", bos="<|im_start|>", eos="<|im_end|>", pad="<|im_end|>",
        unk="<|endoftext|>", stop=("<|im_end|>",)),
}


@dataclass(frozen=True)
class Family:
    config_class: str  # in transformers
    template: str  # default chat template
    rope: dict[str, Any]  # rope_parameters
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    extra: dict[str, Any] = field(default_factory=dict)
    moe: bool = False  # a mixture of experts: num_experts, experts_per_token apply


FAMILIES: dict[str, Family] = {
    # Llama 3.1: llama3 rope scaling (frequency-dependent), untied lm_head as in 8B.
    "llama": Family("LlamaConfig", "llama3.1",
                    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                    1e-5, 131072, False, {"attention_bias": False, "mlp_bias": False}),
    # Qwen2.5 (0.5B's layout): bias on q/k/v, tied embeddings.
    "qwen2": Family("Qwen2Config", "qwen2.5", {"rope_type": "default", "rope_theta": 1000000.0},
                    1e-6, 32768, True, {"use_sliding_window": False}),
    # Qwen3 (0.6B's layout): q_norm / k_norm, explicit head_dim, no qkv bias, tied embeddings.
    "qwen3": Family("Qwen3Config", "qwen3", {"rope_type": "default", "rope_theta": 1000000.0},
                    1e-6, 40960, True, {"attention_bias": False, "use_sliding_window": False}),
    # Qwen3-MoE (30B-A3B's layout): Qwen3's attention, every MLP a mixture of experts with
    # softmax top-k routing, the top-k weights renormalised, untied embeddings.
    "qwen3_moe": Family("Qwen3MoeConfig", "qwen3", {"rope_type": "default", "rope_theta": 1000000.0},
                        1e-6, 40960, False, {"attention_bias": False, "use_sliding_window": False,
                                             "decoder_sparse_step": 1, "mlp_only_layers": [],
                                             "norm_topk_prob": True, "router_aux_loss_coef": 0.001},
                        moe=True),
}
MOE_DEFAULTS = {"num_experts": 8, "experts_per_token": 2}


def template_text(name: str) -> str:
    """A published chat template, verbatim (rlexp/models/templates/<name>.jinja)."""
    path = TEMPLATE_DIR / f"{name}.jinja"
    if name not in LAYOUTS or not path.is_file():
        raise ValueError(f"model.chat_template={name!r}: choose from {sorted(LAYOUTS)}")
    return path.read_text()


def build_arch_model(
    family: str,
    cache_dir: str,
    seed: int,
    chat_template: str | None = None,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int | None = None,
    bpe_vocab_size: int = 4096,
    vocab_size: int | None = None,
    tie_word_embeddings: bool | None = None,
    num_experts: int | None = None,
    experts_per_token: int | None = None,
) -> str:
    """Return the path of the built model directory, building it on first use.

    `chat_template`: a name in rlexp/models/templates (default: the family's own); the
    tokenizer's special tokens follow it. `bpe_vocab_size`: bytes + merges (4096 = 256 byte
    tokens + 3840 merges, at most: training stops when no pair occurs twice). `vocab_size`:
    the model's embedding rows, at least the tokenizer's size (null: the tokenizer's, padded
    to a multiple of 64). `tie_word_embeddings`: null = as the family's published models.
    `num_experts`, `experts_per_token`: an MoE family's (null: 8 and 2; `intermediate_size`
    is then each expert's, null: hidden_size)."""
    if family not in FAMILIES:
        raise ValueError(f"model.family={family!r}: choose from {sorted(FAMILIES)}")
    fam = FAMILIES[family]
    chat_template = chat_template or fam.template
    template_text(chat_template)  # fail on a bad name before any work
    if hidden_size % num_heads or hidden_size // num_heads not in HEAD_DIMS:
        raise ValueError(f"model: hidden_size/num_heads = {hidden_size / num_heads:g}; vLLM's CPU attention "
                         f"needs a head dim in {HEAD_DIMS}")
    if num_heads % num_kv_heads:
        raise ValueError(f"model: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if bpe_vocab_size < 512:
        raise ValueError(f"model.bpe_vocab_size={bpe_vocab_size}: at least 512 (256 byte tokens + merges)")
    moe: dict[str, int | None] = {"num_experts": num_experts, "experts_per_token": experts_per_token}
    if fam.moe:
        experts = num_experts or MOE_DEFAULTS["num_experts"]
        top_k = experts_per_token or MOE_DEFAULTS["experts_per_token"]
        if not 1 <= top_k <= experts:
            raise ValueError(f"model: experts_per_token={top_k} must be in 1..num_experts={experts}")
        moe = {"num_experts": experts, "experts_per_token": top_k}
    elif any(v is not None for v in moe.values()):
        raise ValueError(f"model.family={family!r} is not a mixture of experts: num_experts and "
                         "experts_per_token apply to qwen3_moe")
    # the cache key: a dense family's holds no MoE arguments
    args = {k: v for k, v in locals().items()
            if k not in ("cache_dir", "fam", "moe", "experts", "top_k", *moe)} | (moe if fam.moe else {})
    return cached_build(f"{family}-{chat_template}", args, FORMAT_VERSION, cache_dir,
                        lambda out: _build(out, **args))


def cached_build(prefix: str, args: dict[str, Any], version: int, cache_dir: str,
                 build: Callable[[Path], None]) -> str:
    """`<cache_dir>/<prefix>-<hash of args and version>`, made by `build(tmp_dir)` on first use
    and renamed into place atomically: a crashed build never leaves a half-written entry, and
    concurrent builds of the same key each write their own temporary directory."""
    key = hashlib.sha1(json.dumps(args | {"v": version}, sort_keys=True).encode()).hexdigest()[:12]
    out = Path(cache_dir).expanduser().resolve() / f"{prefix}-{key}"
    if (out / "config.json").exists():
        log.info("%s: cached at %s", prefix, out)
        return str(out)
    t0 = time.time()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        from rlexp.models.tiny import build_environment

        made_with = build_environment() | {"python": platform.python_version()}
        (tmp / "rlexp_build.json").write_text(json.dumps(args | made_with | {"v": version}, indent=2))
        if (out / "config.json").exists():  # another process finished first: same bytes, keep theirs
            shutil.rmtree(tmp)
            return str(out)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("%s: built %s in %.1fs", prefix, out, time.time() - t0)
    return str(out)


def _build(out: Path, family: str, seed: int, chat_template: str, hidden_size: int, num_layers: int,
           num_heads: int, num_kv_heads: int, intermediate_size: int | None, bpe_vocab_size: int,
           vocab_size: int | None, tie_word_embeddings: bool | None, num_experts: int | None = None,
           experts_per_token: int | None = None) -> None:
    import torch  # here, not at the top: a cached model is found without importing torch
    import transformers

    fam = FAMILIES[family]
    tokenizer = build_tokenizer(chat_template, bpe_vocab_size)
    layout = LAYOUTS[chat_template]
    ids = tokenizer.convert_tokens_to_ids
    vocab = vocab_size or -(-len(tokenizer) // 64) * 64  # padded, as the published checkpoints are
    if vocab < len(tokenizer):
        raise ValueError(f"model.vocab_size={vocab_size}: less than the tokenizer's {len(tokenizer)} tokens")
    config = getattr(transformers, fam.config_class)(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        hidden_act="silu",
        max_position_embeddings=fam.max_position_embeddings,
        rms_norm_eps=fam.rms_norm_eps,
        rope_parameters=dict(fam.rope),
        tie_word_embeddings=fam.tie_word_embeddings if tie_word_embeddings is None else tie_word_embeddings,
        bos_token_id=ids(layout.config_bos or layout.bos) if (layout.config_bos or layout.bos) else None,
        eos_token_id=[ids(t) for t in layout.stop] if layout.config_stops else ids(layout.eos),
        pad_token_id=ids(layout.pad) if layout.pad else None,
        dtype="float32",
        **fam.extra,
        **({"num_experts": num_experts, "num_experts_per_tok": experts_per_token,
            "moe_intermediate_size": intermediate_size or hidden_size} if fam.moe else {}),
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=[ids(t) for t in layout.stop],
        pad_token_id=config.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


# ---- the tokenizer -----------------------------------------------------------------------


def build_tokenizer(chat_template: str, bpe_vocab_size: int = 4096):
    """A byte-level BPE trained on `corpus()` (rlexp/models/tokenizer_corpus.py), with
    `chat_template`'s tokenizer layout and the template itself, as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors, trainers
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    layout = LAYOUTS[chat_template]
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=layout.pre_tokenizer == "gpt2")
    tok = Tokenizer(models.BPE())
    if layout.pre_tokenizer == "gpt2":
        tok.pre_tokenizer = byte_level
    else:
        pattern = LLAMA3_PATTERN if layout.pre_tokenizer == "llama3" else QWEN2_PATTERN
        tok.pre_tokenizer = pre.Sequence([pre.Split(Regex(pattern), behavior="isolated"), byte_level])
    if layout.nfc:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    first = list(layout.specials) if layout.specials_first else []
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab_size + len(first), min_frequency=2,
                                  show_progress=False, initial_alphabet=pre.ByteLevel.alphabet(),
                                  special_tokens=first)
    tok.train_from_iterator(corpus(), trainer)
    if not layout.specials_first:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in layout.specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in layout.plain])
    byte_post = processors.ByteLevel(trim_offsets=False)
    if layout.add_bos:
        assert layout.bos is not None
        bos = (layout.bos, tok.token_to_id(layout.bos))
        tok.post_processor = processors.Sequence([byte_post, processors.TemplateProcessing(
            single=f"{layout.bos}:0 $A:0", pair=f"{layout.bos}:0 $A:0 {layout.bos}:1 $B:1",
            special_tokens=[bos])])
    else:
        tok.post_processor = byte_post
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=layout.bos, eos_token=layout.eos, pad_token=layout.pad,
        unk_token=layout.unk, clean_up_tokenization_spaces=False, model_max_length=131072,
        chat_template=template_text(chat_template))
