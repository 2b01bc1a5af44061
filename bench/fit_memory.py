"""Peak memory and time of the trainer's fit at real sizes: the vocabulary's logits scored in
chunks (`trainer.logits_chunk_tokens`, the default) against one chunk of all positions (what
the trainer held before chunking: the full [positions, vocab] logits and their copies).

    .venv/bin/python bench/fit_memory.py [--models smollm2 qwen2_150k] [--tokens 512 2048 8192]
                                         [--chunk 256 [128 ...]] [--dtype float32]
                                         [--gradient-checkpointing] [--out F.json]

Models, built locally with random weights (nothing downloaded; memory and time do not depend
on the weights): `smollm2` is SmolLM2-135M's layout (Llama, hidden 576, 30 layers, 9 heads /
3 KV heads, vocabulary 49,152, tied head); `qwen2_150k` is Qwen2's layout at the same size with
Qwen2's vocabulary of 151,936 (tied): 195M parameters, 87M of them the embedding.

Each measurement is a child process of its own (a clean peak): a TrainController fits a
batch of one row of `--tokens` tokens (64 of prompt) and one of 128 (rewards 1 and 0, so
the update carries signal), `micro_batch_tokens` = the row, AdamW, the sync check off. The
peak is the process's VmHWM over one fit (reset before it through /proc/self/clear_refs);
`fit MB` is that peak less the resident size just before the fit: what the fit itself
adds. At <= 2048 tokens the first fit warms up (AdamW's state is allocated) and the second is
measured; at 8192 the one fit is (its AdamW state included). A child that runs out of memory
(address space capped at `--limit-gb`) is reported as not fitting. The headline is
chunked / one chunk of the fit's own peak, qwen2_150k at 2048 tokens."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
              num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=16384)
MODELS = {"smollm2": ("LlamaConfig", 49152, 100000.0), "qwen2_150k": ("Qwen2Config", 151936, 1000000.0)}
ONE_CHUNK = 10**9
OUT_OF_MEMORY = ("MemoryError", "can't allocate memory", "std::bad_alloc", "out of memory")


def build(name: str, out: Path, dtype: str) -> str:
    """The model `name` with random weights, saved to `out/name` (once)."""
    import torch
    import transformers

    path = out / f"{name}-{dtype}"
    if not (path / "config.json").exists():
        cls, vocab, theta = MODELS[name]
        config = getattr(transformers, cls)(vocab_size=vocab, rope_theta=theta, **LAYOUT)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        model.save_pretrained(path)
    return str(path)


def _status(key: str) -> int:
    """A /proc/self/status size in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _batch(tokens: int, vocab: int):
    import random

    from rlexp.sample import Sample, Status, TokenTrace

    g = random.Random(0)
    out = []
    for n, reward in ((tokens, 1.0), (128, 0.0)):
        ids = [g.randrange(vocab) for _ in range(n)]
        trace = TokenTrace(ids, [0] * 64 + [1] * (n - 64), [0.0] * 64 + [-2.0] * (n - 64), [0] * n)
        out.append(Sample(group_id=0, prompt=[], answer="", trace=trace, reward=reward,
                          status=Status.COMPLETED))
    return out


def child(path: str, tokens: int, chunk: int, dtype: str, checkpointing: bool) -> dict:
    """One measurement, in this process: {"rss_mb", "peak_mb", "fit_mb", "fit_s"}."""
    import torch

    from rlexp.trainer.controller import TrainController
    from rlexp.trainer.sync_check import SyncCheck

    torch.manual_seed(0)
    trainer = TrainController(path, temperature=1.0, total_steps=10, micro_batch_tokens=tokens,
                              logits_chunk_tokens=chunk, dtype=dtype, ref_kl_every_n_steps=0,
                              gradient_checkpointing=checkpointing,
                              optimizer=partial(torch.optim.AdamW, lr=1e-5),
                              sync_check=partial(SyncCheck, bound="off"))
    batch = _batch(tokens, trainer.model.config.vocab_size)
    for fit in range(2 if tokens <= 2048 else 1):
        rss = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        start = time.perf_counter()
        trainer.fit(batch, fit)
        seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    mb = 2**20
    return {"rss_mb": rss / mb, "peak_mb": peak / mb, "fit_mb": (peak - rss) / mb, "fit_s": seconds}


def measure(path: str, tokens: int, chunk: int, dtype: str, checkpointing: bool,
            limit_gb: float) -> dict | None:
    """`child` in a process of its own; None when it ran out of memory."""
    def cap() -> None:
        limit = int(limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    args = [path, str(tokens), str(chunk), dtype, str(int(checkpointing))]
    proc = subprocess.run([sys.executable, __file__, "--child", *args],
                          capture_output=True, text=True, cwd=ROOT, preexec_fn=cap)
    if proc.returncode != 0:
        if proc.returncode < 0 or any(m in proc.stderr for m in OUT_OF_MEMORY):
            return None
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[512, 2048, 8192])
    p.add_argument("--chunk", type=int, nargs="+", default=[256],
                   help="logits_chunk_tokens of the chunked side (several: a side each; the first one "
                        "is the headline's)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--gradient-checkpointing", action="store_true", help="trainer.gradient_checkpointing")
    p.add_argument("--limit-gb", type=float, default=20.0, help="each child's address space cap")
    p.add_argument("--out", help="write every figure to this JSON file")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            path = build(model, Path(tmp), a.dtype)
            for tokens in a.tokens:
                sides = [("one chunk", ONE_CHUNK)] + [(_side(c, a.chunk), c) for c in a.chunk]
                for side, chunk in sides:
                    r = measure(path, tokens, chunk, a.dtype, a.gradient_checkpointing, a.limit_gb)
                    results.append({"model": model, "tokens": tokens, "side": side, **(r or {"fits": False})})
                    figures = _figures(r, tokens) if r else f"out of memory under a {a.limit_gb:.0f} GB cap"
                    print(f"{model:11s} {tokens:6d} tokens  {side:10s}  {figures}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    _headline(results, a.chunk[0])


def _side(chunk: int, chunks: list[int]) -> str:
    return "chunked" if chunk == chunks[0] else f"chunk {chunk}"


def _figures(r: dict, tokens: int) -> str:
    per_token_kb = r["fit_mb"] * 1024 / tokens
    return (f"peak {r['peak_mb']:8.0f} MB  fit {r['fit_mb']:8.0f} MB ({per_token_kb:6.1f} KB/token)  "
            f"fit {r['fit_s']:6.2f} s")


def _headline(results: list[dict], chunk: int) -> None:
    def get(model, tokens, side, key):
        r = next((r for r in results if (r["model"], r["tokens"], r["side"]) == (model, tokens, side)), None)
        return r.get(key) if r else None

    for model in MODELS:
        before, after = get(model, 2048, "one chunk", "fit_s"), get(model, 2048, "chunked", "fit_s")
        if before and after:
            print(f"{model} 2048 tokens: fit time chunked / one chunk = {after / before:.3f}")
    before = get("qwen2_150k", 2048, "one chunk", "fit_mb")
    after = get("qwen2_150k", 2048, "chunked", "fit_mb")
    if before and after:
        print(f"ratio: {after / before:.3f}  (qwen2_150k, 2048-token rows: the fit's own peak, "
              f"chunk {chunk} / one chunk)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        path, tokens, chunk, dtype, *checkpointing = sys.argv[2:]
        print(json.dumps(child(path, int(tokens), int(chunk), dtype, checkpointing == ["1"])))
    else:
        main()
