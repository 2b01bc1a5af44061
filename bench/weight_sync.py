"""Weight sync over its memcpy floor, for the tiny model and a ~120M-parameter model.

    .venv/bin/python bench/weight_sync.py [--reps 7] [--models tiny,qwen2-120m]

Per model, one vLLM engine and the model's weights as the trainer holds them. Timed, side
by side, alternating:
  floor        one `copy_` of every weight tensor into a preallocated buffer (the bytes
               must move at least once)
  ram_file     rlexp's transport: the trainer's tensors copied into a mapped safetensors file
               in /dev/shm, then vLLM's in-place reload from views of that file
  file_reload  what rlexp did before: `safetensors.save_file` into /dev/shm, then vLLM's
               `reload_weights(weights_path=...)` (reads and parses the file)
Between repetitions the weights change a little, so every sync moves new numbers. The
~120M model is built locally from a real architecture config (Qwen2: 12 layers, hidden 768,
vocabulary 32768, tied embeddings) with random weights and the tiny model's tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_config, default_model, median  # noqa: E402

from rlexp.rollout.vllm_engine import VLLMEngine  # noqa: E402
from rlexp.rollout.weights import RamFileTransport, save_safetensors  # noqa: E402


def qwen2_120m(tokenizer_dir: str, out: Path) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    cfg = Qwen2Config(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                      num_key_value_heads=4, vocab_size=32768, tie_word_embeddings=True,
                      max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return str(out)


async def bench_model(name: str, path: str, reps: int) -> dict[str, list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"\n{name}: {n_params / 1e6:.1f}M parameters, state dict {n_bytes / 1e6:.0f} MB "
          "(tied counted twice)")
    engine = VLLMEngine(path, seed=0, max_model_len=256, kv_cache_gb=0.25)
    transport = RamFileTransport()
    old_dir = Path(tempfile.mkdtemp(prefix="rlexp-bench-", dir="/dev/shm"))
    dst = {k: torch.empty_like(v) for k, v in model.state_dict().items()}

    def floor():
        with torch.no_grad():
            for k, v in model.state_dict().items():
                dst[k].copy_(v)

    async def file_reload():
        save_safetensors(model.state_dict().items(), old_dir)
        await engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(old_dir)})

    times: dict[str, list[float]] = {"floor": [], "ram_file": [], "file_reload": []}
    try:
        for rep in range(reps + 1):  # the first round warms up (first mapping, page faults), untimed
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.0001)
            order = ["floor", "ram_file", "file_reload"]
            for what in order if rep % 2 else order[::-1]:
                t0 = time.perf_counter()
                if what == "floor":
                    floor()
                elif what == "ram_file":
                    await transport.transfer(model.state_dict().items(), engine, rep)
                else:
                    await file_reload()
                if rep:
                    times[what].append(time.perf_counter() - t0)
    finally:
        engine.shutdown()
        transport.close()
        shutil.rmtree(old_dir, ignore_errors=True)
    for what, ts in times.items():
        print(f"  {what:12} median {median(ts):.3f} s  ({' '.join(f'{t:.3f}' for t in ts)})")
    f = median(times["floor"])
    print(f"  ram_file / floor {median(times['ram_file']) / f:.2f}   file_reload / floor "
          f"{median(times['file_reload']) / f:.2f}   file_reload / ram_file "
          f"{median(times['file_reload']) / median(times['ram_file']):.2f}")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--models", default="tiny,qwen2-120m")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    tiny = default_model(default_config())
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"tiny": tiny, "qwen2-120m": lambda: qwen2_120m(tiny, Path(tmp) / "qwen2-120m")}
        for name in args.models.split(","):
            path = paths[name]
            results[name] = asyncio.run(bench_model(name, path() if callable(path) else path, args.reps))
    last = results[args.models.split(",")[-1]]
    print(f"ratio: {median(last['ram_file']) / median(last['floor']):.3f}")


if __name__ == "__main__":
    main()
