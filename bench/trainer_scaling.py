"""Trainer throughput: 1 worker vs 2 ranks (torchrun, gloo, FSDP2), and fit over its raw floor.

    .venv/bin/python bench/trainer_scaling.py [--reps 8] [--blocks 2] [--samples 256]
        [--min-len 10] [--max-len 30] [--model PATH] [--fsdp1] [trainer.key=value ...]

One fixed batch, the same in every process: --samples sequences (groups of --group-size,
random 0/1 rewards) of --min-len..--max-len tokens, the last 2..rollout.max_response_tokens
of them the trained response (the default task's shape: short arithmetic prompts, answers of
a few tokens). The trainer is the default experiment's (conf/trainer/default.yaml and the
algorithm groups, plus any overrides), on the default tiny model, or on --model PATH (a local
HF checkpoint, with conf/model/local.yaml's trainer settings).

Measured, each side in its own fresh process(es), sides alternating over --blocks blocks:
  1 worker   TrainController.fit in one plain process, no process group (unsharded);
  2 workers  the same under `python -m torch.distributed.run --nproc-per-node 2` (gloo,
             FSDP2: each rank holds half the model and trains its token-balanced half of
             the rows, gradients reduced over gloo); rank 0 writes the timings, each fit's
             time being the slowest rank's;
  raw        (in the 1-worker process, alternating with its fits) the floor: the same padded
             rows cut into the same micro-batches (TrainBatch.build's micro_batches, built
             once, untimed), a plain HF forward, log_softmax, the target tokens' logprobs, a
             masked mean over the trained tokens, backward, grad clipping, AdamW; no GRPO
             bookkeeping (advantages, ratios, clipping, metrics).
  --fsdp1    adds torchrun with 1 rank (FSDP2 over a world of 1): FSDP's own cost without a
             second process.
Each process does one untimed warm-up fit (and raw step) first; medians over the rest.
tokens/s = trained response tokens (the batch's loss-mask sum) / fit seconds.

Threads: the machine's cores are split evenly over the ranks (1 worker: all of them; 2 ranks:
half each, via OMP_NUM_THREADS and torch.set_num_threads). On a 2-core CPU the 2-rank figure
is mostly overhead, not scaling: the two ranks share the same 2 cores the single worker
already used, and add gloo all-gathers/reduce-scatters of every layer plus a second Python
process; it is a correctness-path cost measure, not what 2 GPUs would give.

Headline (the LAST line, `ratio: X`): 2 workers' tokens/s over 1 worker's (> 1: the second
rank speeds the trainer up). Also printed: fit over raw fwd+bwd (seconds of fit / seconds
of the floor on the same rows in the same process; >= 1 is the trainer's overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


# ---- the batch (every process builds the same one from the spec) ---------------------
def make_batch(spec: dict):
    from rlexp.sample import Sample, Status, TokenTrace

    g = random.Random(spec["seed"])
    lo_tok, vocab = 3, spec["vocab_size"]  # leave the special tokens alone
    out = []
    for i in range(spec["samples"]):
        n = g.randint(spec["min_len"], spec["max_len"])
        n_resp = g.randint(min(2, n - 1), max(min(2, n - 1), min(spec["max_response"], n - 1)))
        n_prompt = n - n_resp
        tokens = [g.randrange(lo_tok, vocab) for _ in range(n)]
        logprobs = [0.0] * n_prompt + [-g.random() * 3 for _ in range(n_resp)]
        s = Sample(group_id=i // spec["group_size"], prompt=[], answer="",
                   trace=TokenTrace(tokens, [0] * n_prompt + [1] * n_resp, logprobs, [0] * n))
        s.reward, s.status = float(g.random() > 0.5), Status.COMPLETED
        out.append(s)
    return out


# ---- worker: runs in each timed process ----------------------------------------------
class Raw:
    """The floor: plain HF forward/backward + AdamW over the trainer's micro-batches."""

    def __init__(self, model_path: str, trainer_cfg: dict, device):
        import torch
        from hydra.utils import instantiate
        from omegaconf import OmegaConf
        from transformers import AutoModelForCausalLM

        from rlexp.models.local import resolve_dtype

        dtype = getattr(torch, resolve_dtype(trainer_cfg.get("dtype", "float32")))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).train()
        self.opt = instantiate(OmegaConf.create(trainer_cfg["optimizer"]))(self.model.parameters())
        self.max_grad_norm, self.device = trainer_cfg.get("max_grad_norm", 1.0), device

    def step(self, tb, micro_batches) -> None:
        import torch

        n_tokens = float(tb.loss_mask.sum())
        for mb in micro_batches:
            ids = tb.input_ids[mb.rows, :mb.width].to(self.device)
            mask = tb.loss_mask[mb.rows, mb.columns].to(self.device)
            logits = self.model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
            (-(logp * mask).sum() / n_tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def worker(spec_path: str, out_path: str) -> None:
    import torch
    import torch.distributed as dist
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from rlexp.trainer import distributed
    from rlexp.trainer.batch import Layout, TrainBatch

    spec = json.loads(Path(spec_path).read_text())
    if "WORLD_SIZE" in os.environ:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = distributed.rank_world()
    torch.set_num_threads(spec["threads"])
    dev = distributed.device()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    batch = make_batch(spec)
    torch.manual_seed(0)
    trainer = instantiate(OmegaConf.create(spec["trainer"]), model_path=spec["model"], workers=world)
    raw = Raw(spec["model"], spec["trainer"], dev) if spec["raw"] else None
    tb = TrainBatch.build(batch, 0, Layout(micro_batch_tokens=trainer.learner.layout.micro_batch_tokens))
    micro_batches = tb.micro_batches

    fit_s, raw_s, metrics = [], [], {}
    for rep in range(1 + spec["reps"]):  # rep 0 warms up, untimed
        if world > 1:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        metrics = trainer.fit(batch, rep)
        sync()
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        distributed.all_reduce_(elapsed, "max")  # a step lasts as long as its slowest rank
        if rep:
            fit_s.append(elapsed.item())
        if raw is not None:
            sync()
            t0 = time.perf_counter()
            raw.step(tb, micro_batches)
            sync()
            if rep:
                raw_s.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out_path).write_text(json.dumps({
            "world": world, "threads": torch.get_num_threads(), "fit_s": fit_s, "raw_s": raw_s,
            "response_tokens": float(tb.loss_mask.sum()), "tokens": sum(tb.lengths),
            "padded": list(tb.input_ids.shape), "micro_batches": len(micro_batches),
            "pad_frac": metrics.get("train/pad_frac")}))
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- parent ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_side(name: str, spec: dict, nproc: int, torchrun: bool, cores: int) -> dict:
    """One fresh process (or `nproc` torchrun ranks) fitting the batch; its timings."""
    threads = max(1, cores // nproc)
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec | {"threads": threads, "raw": spec["raw"] and not torchrun}))
        cmd = [sys.executable, str(HERE), "--worker", str(spec_path), "--out", str(out_path)]
        if torchrun:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                   "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}", *cmd[1:]]
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if res.returncode != 0 or not out_path.exists():
            sys.exit(f"side {name} failed ({' '.join(cmd)}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
        out = json.loads(out_path.read_text())
        out["wall_s"] = time.perf_counter() - t0
        return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=8, help="timed fits per process (after 1 warm-up)")
    p.add_argument("--blocks", type=int, default=2, help="processes per side, sides alternating")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--min-len", type=int, default=10)
    p.add_argument("--max-len", type=int, default=30)
    p.add_argument("--max-response", type=int, help="default: the config's rollout.max_response_tokens")
    p.add_argument("--model", help="a local HF checkpoint (default: the tiny model)")
    p.add_argument("--fsdp1", action="store_true", help="also time torchrun with 1 rank (FSDP2, world 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.micro_batch_tokens=2048")
    return p.parse_args()


def make_spec(args: argparse.Namespace) -> tuple[str, dict]:
    """The model's path and the spec every side's process fits: the batch's shape, the model
    and the trainer config (the default experiment's, with --model and the overrides)."""
    from common import default_config, default_model
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    cfg = default_config((["model=local", f"model.path={args.model}"] if args.model else []) + args.overrides)
    model_path = default_model(cfg)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer_cfg.pop("workers", None)
    spec = {"seed": args.seed, "samples": args.samples, "group_size": args.group_size,
            "min_len": args.min_len, "max_len": args.max_len,
            "max_response": args.max_response or cfg.rollout.max_response_tokens,
            "vocab_size": AutoConfig.from_pretrained(model_path).vocab_size,
            "model": model_path, "trainer": trainer_cfg, "reps": args.reps, "raw": True}
    return model_path, spec


def run_blocks(spec: dict, sides: dict, blocks: int, cores: int) -> dict[str, list[dict]]:
    """Each side's fresh process(es) once per block, the sides' order alternating from block
    to block; a line per process as it ends. Each side's timings, block by block."""
    from common import median

    results: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for b in range(blocks):
        for name in names if b % 2 == 0 else names[::-1]:
            r = run_side(name, spec, *sides[name], cores)
            results[name].append(r)
            extra = f"  raw {median(r['raw_s']):.3f} s" if r["raw_s"] else ""
            print(f"block {b} {name:<12} fit {median(r['fit_s']):.3f} s{extra}  "
                  f"({r['threads']} thread(s)/rank, process wall {r['wall_s']:.0f} s)", flush=True)
    return results


def print_table(samples: int, sides: dict, results: dict[str, list[dict]]) -> tuple[dict, float, float]:
    """The batch, then a row per side (and the raw floor): its median fit and throughputs.
    Returns the sides' median fit seconds, the raw floor's, and the trained response tokens."""
    from common import median

    names = list(sides)
    first = results[names[0]][0]
    resp, toks = first["response_tokens"], first["tokens"]
    print(f"\nbatch: {samples} samples, {toks} tokens ({resp:.0f} trained response tokens), padded "
          f"{tuple(first['padded'])}, {first['micro_batches']} micro-batch(es), "
          f"pad_frac {first['pad_frac']:.3f}")
    fit = {name: median([t for r in rs for t in r["fit_s"]]) for name, rs in results.items()}
    raw = median([t for r in results["1 worker"] for t in r["raw_s"]])
    print(f"{'':16} {'ranks':>5} {'thr/rank':>8} {'median s':>9} {'resp tok/s':>11} {'all tok/s':>10}  "
          "all fits (s)")
    rows = [(name, sides[name][0], results[name][0]["threads"], fit[name],
             [t for r in results[name] for t in r["fit_s"]]) for name in names]
    rows.append(("raw fwd+bwd", 1, results["1 worker"][0]["threads"], raw,
                 [t for r in results["1 worker"] for t in r["raw_s"]]))
    for name, ranks, thr, s, ts in rows:
        print(f"{name:16} {ranks:5d} {thr:8d} {s:9.3f} {resp / s:11.0f} {toks / s:10.0f}  "
              + " ".join(f"{t:.3f}" for t in ts))
    return fit, raw, resp


def print_verdict(fit: dict, raw: float, resp: float, load0: float, cores: int, fsdp1: bool) -> None:
    """The load during the run, what the 2-worker figure means here, then the ratios, the
    headline (`ratio: X`) last."""
    one, two = resp / fit["1 worker"], resp / fit["2 workers"]
    load1 = os.getloadavg()[0]
    print(f"load average (1 min) at start {load0:.2f}, at end {load1:.2f}"
          + (f": above the {cores} cores, other processes competed for the CPU and the times are noisy"
             if max(load0, load1) > cores + 0.5 else ""))
    if cores <= 2:
        print(f"note: {cores} cores here: the 2 ranks share the cores the 1 worker used alone, so the "
              "2-worker figure measures overhead (gloo collectives, a second process), not scaling")
    if fsdp1:
        print(f"FSDP2 over 1 rank / unsharded: {fit['fsdp 1 rank'] / fit['1 worker']:.3f}x the fit time")
    print(f"tokens/s 1 worker: {one:.0f}, 2 workers: {two:.0f} (2 workers / 1: {two / one:.3f})")
    print(f"fit over raw fwd+bwd: {fit['1 worker'] / raw:.3f}")
    print(f"ratio: {two / one:.3f}")


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args.worker, args.out)

    sys.path.insert(0, str(HERE.parent))  # bench/common.py, which the parent's steps import
    model_path, spec = make_spec(args)
    cores = len(os.sched_getaffinity(0))
    sides = {"1 worker": (1, False), "2 workers": (2, True)}
    if args.fsdp1:
        sides["fsdp 1 rank"] = (1, True)
    print(f"model {model_path}; {cores} cores; {args.samples} samples of {args.min_len}-{args.max_len} "
          f"tokens, responses 2-{spec['max_response']}; {args.blocks} blocks x {args.reps} timed fits "
          "per side", flush=True)
    load0 = os.getloadavg()[0]
    results = run_blocks(spec, sides, args.blocks, cores)
    fit, raw, resp = print_table(args.samples, sides, results)
    print_verdict(fit, raw, resp, load0, cores, args.fsdp1)

if __name__ == "__main__":
    main()
