"""Streamed vs non-streamed replies of rlexp's server: time to first token, tokens/s, one run.

    .venv/bin/python bench/streaming.py [--reps 20 --tokens 64] [--model tiny|135m]

One vLLM engine behind rlexp's server on loopback; the real `openai` package sends the same
seeded chat request (64 new tokens: the end-of-turn token is banned with `logit_bias`, so
every reply has exactly that many) streamed and not, alternating, one request at a time.
Per request: the non-streamed reply's total time; the streamed one's time to its first
content chunk (TTFT) and to its end. Medians. The model: the default tiny one, or a
135M-parameter Llama built locally with random weights (`--model 135m`, as in
bench/weight_sync.py).

Reported: TTFT over the non-streamed total (how soon a streaming client sees text), and
streamed tokens/s over non-streamed tokens/s (what streaming costs). Headline: the first."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build_model(kind: str) -> str:
    from common import default_config, default_model

    if kind == "tiny":
        return default_model(default_config())
    from weight_sync import llama_135m

    return llama_135m()  # built once, then cached under ~/.cache/rlexp/models


async def run(model_path: str, reps: int, tokens: int) -> None:
    import openai
    from transformers import AutoTokenizer

    from rlexp.chat.client import SessionStore
    from rlexp.chat.server import ChatServer
    from rlexp.rollout.vllm_engine import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    engine = VLLMEngine(model_path, seed=0, max_model_len=512, kv_cache_gb=0.5, max_num_seqs=8)
    store = SessionStore(engine, tokenizer, max_context=512)
    server = ChatServer(store)
    await server.start()
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    body = dict(model="policy", messages=[{"role": "user", "content": "12+34="}], max_tokens=tokens,
                temperature=1.0, logit_bias={str(eot): -100})
    plain, ttft, streamed = [], [], []
    try:
        for rep in range(reps + 1):  # the first of each is a warm-up
            for stream in ([False, True] if rep % 2 == 0 else [True, False]):
                sid = store.open()
                t0 = time.perf_counter()
                if stream:
                    first, n = None, 0
                    async for chunk in await client.chat.completions.create(
                            stream=True, seed=rep, extra_body={"session_id": sid}, **body):
                        if chunk.choices and chunk.choices[0].delta.content and first is None:
                            first = time.perf_counter() - t0
                        extra = (chunk.choices[0].model_extra or {}) if chunk.choices else {}
                        n += len(extra.get("token_ids", []))
                    total = time.perf_counter() - t0
                    if rep:
                        ttft.append(first)
                        streamed.append(total)
                    assert n == tokens, n
                else:
                    r = await client.chat.completions.create(seed=rep, extra_body={"session_id": sid}, **body)
                    if rep:
                        plain.append(time.perf_counter() - t0)
                    assert len(r.choices[0].model_extra["token_ids"]) == tokens
                store.close(sid)
    finally:
        await server.stop()
        engine.shutdown()
    med = statistics.median
    print(f"{reps} requests each, {tokens} new tokens: non-streamed {med(plain) * 1e3:.1f} ms; streamed: "
          f"first token {med(ttft) * 1e3:.1f} ms, whole {med(streamed) * 1e3:.1f} ms")
    print(f"tokens/s streamed over non-streamed: {med(plain) / med(streamed):.3f}")
    print(f"ratio: {med(ttft) / med(plain):.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--model", choices=["tiny", "135m"], default="tiny")
    args = p.parse_args()
    asyncio.run(run(build_model(args.model), args.reps, args.tokens))


if __name__ == "__main__":
    main()
