"""Weight sync over its memcpy floor, for the tiny model and ~130M-parameter models.

    .venv/bin/python bench/weight_sync.py [--reps 7] [--models tiny,llama-135m]

Per model, one vLLM engine and the model's weights as the trainer holds them. Timed, side
by side, alternating:
  floor        every weight tensor copied once into a preallocated buffer (the bytes must move
               at least once): the faster of torch's `copy_` (its thread pool) and one memcpy
               per tensor (one thread); with the machine's other core busy the first is ~10x
               slower (each copy waits for a second thread to be scheduled)
  ram_file     rlexp's default transport (conf/weight_transfer/ram_file.yaml), split into
               write:  the trainer's tensors copied into a mapped safetensors file in /dev/shm
               engine: vLLM's in-place reload from views of that file, and its prefix-cache reset
  ram_file_copy_  the same with the file written by torch's `copy_` (what rlexp did before:
               slow when the machine's other core is busy, as `floor copy_`)
  file_reload  what rlexp did before: `safetensors.save_file` into /dev/shm, then vLLM's
               `reload_weights(weights_path=...)` (reads and parses the file)
Between repetitions the weights change a little, so every sync moves new numbers. Models,
random weights, built locally:
  llama-135m   SmolLM2-135M's shape (LlamaConfig: hidden 576, 30 layers, 9 heads, 3 kv heads,
               intermediate 1536, vocabulary 49152, tied embeddings), rlexp.models.arch
  qwen2-120m   Qwen2Config: 12 layers, hidden 768, vocabulary 32768, tied embeddings, with
               the tiny model's tokenizer
The last line is `ratio: X`, ram_file / floor for the last model.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_config, default_model, median  # noqa: E402

from rlexp.config import cache_root  # noqa: E402
from rlexp.models.arch import build_arch_model  # noqa: E402
from rlexp.rollout.vllm_engine import VLLMEngine  # noqa: E402
from rlexp.weights import files as weights  # noqa: E402
from rlexp.weights.files import save_safetensors  # noqa: E402
from rlexp.weights.ram_file import RamFileTransport  # noqa: E402

CACHE = cache_root() / "models"  # where conf/model/*.yaml build their models


def llama_135m() -> str:
    return build_arch_model("llama", str(CACHE), seed=0, chat_template="smollm2", hidden_size=576,
                            num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
                            vocab_size=49152, tie_word_embeddings=True)


class _TimedEngine:
    """The engine as the transport sees it, timing the engine's part of a transfer."""

    def __init__(self, engine: VLLMEngine):
        self.engine, self.seconds = engine, 0.0

    async def load_weights(self, directory: Path, version: int) -> None:
        t0 = time.perf_counter()
        await self.engine.load_weights(directory, version)
        self.seconds = time.perf_counter() - t0


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


class _Ways:
    """The ways of moving a model's weights that bench_model times, on one model and one engine:
    two floors (a copy_ and a memcpy into preallocated tensors), the ram_file transport (as
    rlexp runs it, and with plain copy_ in place of its fast copy), and vLLM reloading a
    safetensors file."""

    ORDER = ["floor copy_", "floor memcpy", "ram_file", "ram_file_copy_", "file_reload"]

    def __init__(self, model, engine: VLLMEngine):
        self.model, self.engine = model, engine
        self.timed = _TimedEngine(engine)
        self.transport = RamFileTransport()
        self.old_dir = Path(tempfile.mkdtemp(prefix="rlexp-bench-", dir="/dev/shm"))
        self.dst = {k: torch.empty_like(v) for k, v in model.state_dict().items()}

    def floor(self):
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                self.dst[k].copy_(v)

    def floor_memcpy(self):
        for k, v in self.model.state_dict().items():
            ctypes.memmove(self.dst[k].data_ptr(), v.data_ptr(), v.numel() * v.element_size())

    async def file_reload(self):
        save_safetensors(self.model.state_dict().items(), self.old_dir)
        await self.engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self.old_dir)})

    async def ram_file_copy_(self, rep: int):
        fast, weights._copy = weights._copy, lambda dst, src: dst.copy_(src)
        try:
            await self.transport.transfer(self.model.state_dict().items(), self.engine, rep)
        finally:
            weights._copy = fast

    async def run(self, what: str, rep: int) -> None:
        if what == "floor copy_":
            self.floor()
        elif what == "floor memcpy":
            self.floor_memcpy()
        elif what == "ram_file":
            await self.transport.transfer(self.model.state_dict().items(), self.timed, rep)
        elif what == "ram_file_copy_":
            await self.ram_file_copy_(rep)
        else:
            await self.file_reload()

    def close(self):
        self.engine.shutdown()
        self.transport.close()
        shutil.rmtree(self.old_dir, ignore_errors=True)


async def timed_rounds(ways: _Ways, reps: int) -> dict[str, list[float]]:
    """`reps` timed rounds (after one untimed warm-up) of every way, the weights nudged before
    each round, the order reversed every other round; ram_file's time also split into the
    engine's part and the write."""
    times: dict[str, list[float]] = {"floor copy_": [], "floor memcpy": [], "ram_file": [], "  write": [],
                                     "  engine": [], "ram_file_copy_": [], "file_reload": []}
    for rep in range(reps + 1):  # the first round warms up (first mapping, page faults), untimed
        with torch.no_grad():
            for p in ways.model.parameters():
                p.mul_(1.0001)
        order = ways.ORDER
        for what in order if rep % 2 else order[::-1]:
            t0 = time.perf_counter()
            await ways.run(what, rep)
            if rep:
                times[what].append(time.perf_counter() - t0)
                if what == "ram_file":
                    times["  engine"].append(ways.timed.seconds)
                    times["  write"].append(times[what][-1] - ways.timed.seconds)
    return times


def print_times(times: dict[str, list[float]]) -> float:
    """A line per way (median, every repetition), then the ratios; the floor: the faster copy."""
    for what, ts in times.items():
        print(f"  {what:12} median {median(ts):.3f} s  ({' '.join(f'{t:.3f}' for t in ts)})")
    f = min(median(times["floor copy_"]), median(times["floor memcpy"]))
    print(f"  ram_file / floor {median(times['ram_file']) / f:.2f} (write / floor "
          f"{median(times['  write']) / f:.2f}, engine / floor {median(times['  engine']) / f:.2f})   "
          f"ram_file_copy_ / floor {median(times['ram_file_copy_']) / f:.2f}   file_reload / floor "
          f"{median(times['file_reload']) / f:.2f}   file_reload / ram_file "
          f"{median(times['file_reload']) / median(times['ram_file']):.2f}")
    return f


async def bench_model(name: str, path: str, reps: int) -> dict[str, list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    n_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"\n{name}: {n_params / 1e6:.1f}M parameters, state dict {n_bytes / 1e6:.0f} MB "
          "(tied counted twice)")
    ways = _Ways(model, VLLMEngine(path, seed=0, max_model_len=256, kv_cache_gb=0.25))
    try:
        times = await timed_rounds(ways, reps)
    finally:
        ways.close()
    times["floor"] = [print_times(times)]
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--models", default="tiny,llama-135m", help="of tiny, qwen2-120m, llama-135m")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    tiny = default_model(default_config())
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"tiny": tiny, "qwen2-120m": lambda: qwen2_120m(tiny, Path(tmp) / "qwen2-120m"),
                 "llama-135m": llama_135m}
        for name in args.models.split(","):
            path = paths[name]
            results[name] = asyncio.run(bench_model(name, path() if callable(path) else path, args.reps))
    last = results[args.models.split(",")[-1]]
    print(f"ratio: {median(last['ram_file']) / last['floor'][0]:.3f}")


if __name__ == "__main__":
    main()
