"""A vLLM engine's start and shutdown on the CPU: its worker in the engine core's process
(rlexp's, `distributed_executor_backend=uni`) vs in a process of its own (vLLM's CPU default).

    .venv/bin/python bench/engine_start.py [--reps 3]

Each start is a fresh Python process (as a run's is): import vLLM, start `VLLMEngine` on the
default experiment's model, generate one reply, shut the engine down. The two ways alternate,
`--reps` times each. Printed per way: medians of the engine start (`VLLMEngine(...)`), the
shutdown, and the whole child process (imports included); and whether the first reply's tokens
and logprobs were the same both ways. Headline: the start's median with the worker in its own
process over the start's median with it in the engine core's process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WAYS = ("in_engine", "own_process")


def one_start(way: str, model_path: str) -> dict:
    """In a child process: start, one reply, shut down; the seconds of each and the reply."""
    import asyncio

    from rlexp.rollout import vllm_args
    from rlexp.rollout.vllm_engine import VLLMEngine
    from rlexp.sample import SamplingConfig

    if way == "own_process":  # vLLM's CPU default: no executor asked for, multiprocessing on
        vllm_args.IN_ENGINE_PROCESS.clear()
        vllm_args.CPU_ENV.clear()

    async def main() -> dict:
        t0 = time.perf_counter()
        engine = VLLMEngine(model_path, seed=0, max_model_len=256, kv_cache_gb=0.25)
        t1 = time.perf_counter()
        reply = await engine.generate([1, 2, 3, 4, 5], SamplingConfig(temperature=1.0, max_tokens=8, seed=3))
        t2 = time.perf_counter()
        engine.shutdown()
        return {"start": t1 - t0, "shutdown": time.perf_counter() - t2,
                "tokens": reply.token_ids, "logprobs": reply.logprobs}

    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="starts per way, alternating")
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.way:
        Path(args.out).write_text(json.dumps(one_start(args.way, args.model)))
        return
    from common import default_config, default_model

    model_path = default_model(default_config())
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    out = Path(f"/tmp/engine_start_{id(runs)}.json")
    for rep in range(args.reps):
        for way in WAYS:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--way", way, "--model", model_path, "--out", str(out)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            run = json.loads(out.read_text()) | {"process": time.perf_counter() - t0}
            runs[way].append(run)
            print(f"rep {rep} {way}: start {run['start']:.1f} s, shutdown {run['shutdown']:.1f} s, "
                  f"process {run['process']:.1f} s", flush=True)
    out.unlink()
    med = {way: {k: statistics.median(r[k] for r in runs[way]) for k in ("start", "shutdown", "process")}
           for way in WAYS}
    for way in WAYS:
        print(f"{way}: median start {med[way]['start']:.1f} s, shutdown {med[way]['shutdown']:.1f} s, "
              f"whole process {med[way]['process']:.1f} s")
    first = {way: (runs[way][0]["tokens"], runs[way][0]["logprobs"]) for way in WAYS}
    same = first["in_engine"] == first["own_process"]
    print(f"the same first reply both ways (tokens and logprobs): {same}")
    print(f"ratio: {med['own_process']['start'] / med['in_engine']['start']:.3f}")


if __name__ == "__main__":
    main()
