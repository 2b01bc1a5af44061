"""Sync vs async scheduling on the same workload and the same number of steps, in one run.

    .venv/bin/python bench/async_speedup.py [--workload tail|multiturn] [--steps 30]
                                            [--thresholds 1 2] [--reps 1] [--pin]

Each configuration is a real `python -m rlexp.run` (vLLM, GRPO trainer, MLflow) with the
same seed and workload; only `scheduler=...` differs. Workloads:
  tail       long-tailed response lengths: the tiny model warm-started for only 10 steps,
             so most answers are short but some ramble (p50 ~5, p90 ~17 tokens, up to 64);
             it barely knows arithmetic, so accuracy says little here: this one measures time
  multiturn  the default tiny model with agent=multiturn: 1 to 3 replies per trajectory,
             and it learns (accuracy rises within a few dozen steps)
Reported per configuration, read back
from each run's MLflow store: training-loop wall time (sum of `timing/step_s`: produce +
fit + sync, no engine start-up, no evaluation), whole-process wall time, eval accuracy
before and after, mean rollout-engine and trainer idle fractions, staleness, expired
samples, tokens generated but never trained, response-length percentiles. Ratios are
sync / async wall time (> 1: async is faster), each within one core setting. With --reps > 1
the configurations run in rotating order and the median per configuration is reported.

Core settings. shared: both cores for everyone, as a plain run (vLLM's worker binds its
OpenMP threads itself, the trainer's torch uses both cores). With --pin, the same
configurations also run pinned, the case async is designed for, side by side in the same
table: the driver (trainer, scheduler, agent) under `taskset -c 0` with one torch thread
(OMP_NUM_THREADS=1), the vLLM engine on core 1 (VLLM_CPU_OMP_THREADS_BIND=1 binds its
worker's OpenMP thread; the bench moves every process the driver starts, the engine core and
its worker, and each of their threads, to core 1 as they appear, and prints the cores each
process ended on). The headline is then the pinned one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # before mlflow is imported

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
DRIVER_CORE, ENGINE_CORE = 0, 1
PIN_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(ENGINE_CORE)}
WORKLOADS = {
    "tail": ["model.warm_start_steps=10", "model.warm_start_target_accuracy=1.0",
             "rollout.max_response_tokens=64", "rollout.max_model_len=128",
             "data.prompts_per_step=16", "data.samples_per_prompt=8", "evaluator.prompts=100"],
    "multiturn": ["agent=multiturn", "judge=multiturn", "evaluator.prompts=100"],
}


def pin_descendants(driver: subprocess.Popen, core: int,
                    every_s: float = 0.2) -> dict[int, tuple[str, set[int]]]:
    """Until `driver` exits, move every thread of every process it started (at any depth) onto
    `core` as they appear. Returns, by pid, each process's last seen name ("driver" for
    `driver` itself, which is left where it is) and the cores its threads were last seen on."""
    seen: dict[int, tuple[str, set[int]]] = {}
    root = psutil.Process(driver.pid)
    while driver.poll() is None:
        try:
            procs = [(root, False)] + [(c, True) for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for proc, move in procs:
            try:
                name = "driver" if proc.pid == driver.pid else proc.name()
                cores: set[int] = set()
                for thread in proc.threads():
                    if move and os.sched_getaffinity(thread.id) != {core}:
                        os.sched_setaffinity(thread.id, {core})
                    cores |= os.sched_getaffinity(thread.id)
                seen[proc.pid] = (name, cores)
            except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
                continue  # gone between the listing and the look
        time.sleep(every_s)
    return seen


def run_one(name: str, overrides: list[str], steps: int, workdir: Path, pin: bool = False) -> dict:
    uri = f"sqlite:///{workdir}/{name}.db"
    cmd = [sys.executable, "-m", "rlexp.run", *overrides, f"trainer.total_steps={steps}",
           f"evaluator.every_n_steps={steps}", f"logger.tracking_uri={uri}",
           f"logger.artifact_location={workdir}/{name}-artifacts", f"hydra.run.dir={workdir}/{name}-out",
           f"logger.run_name={name}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false")
    if pin:
        cmd, env = ["taskset", "-c", str(DRIVER_CORE), *cmd], env | PIN_ENV
    t0 = time.time()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        driver = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True, env=env)
        cores = pin_descendants(driver, ENGINE_CORE) if pin else {}
        driver.wait()
        wall = time.time() - t0
        err.seek(0)
        stderr = err.read()
    if driver.returncode != 0:
        sys.exit(f"{name} failed:\n{stderr[-3000:]}")
    if pin:
        print(f"  {name} cores: " + "; ".join(f"{n} (pid {p}) {sorted(c)}" for p, (n, c) in cores.items()),
              flush=True)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])

    def hist(key):
        history = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(history, key=lambda m: m.step)]

    lengths = []
    for step in range(1, steps + 1):
        path = client.download_artifacts(run.info.run_id, f"traces/step_{step:05d}.jsonl")
        lengths += [sum(json.loads(x)["loss_mask"]) for x in Path(path).read_text().splitlines()]
    lengths.sort()
    evals = hist("eval/accuracy")
    return {
        "loop_s": sum(hist("timing/step_s")), "wall_s": wall, "eval_start": evals[0], "eval_end": evals[-1],
        "engine_idle": statistics.mean(hist("rollout/engine_idle_frac")),
        "trainer_idle": statistics.mean(hist("train/idle_frac")),
        "staleness_mean": statistics.mean(hist("rollout/staleness_mean")),
        "staleness_max": max(hist("rollout/staleness_max")),
        "expired": sum(hist("samples/expired")), "untrained_tokens": sum(hist("rollout/untrained_tokens")),
        "len_p50": lengths[len(lengths) // 2], "len_p90": lengths[int(len(lengths) * 0.9)],
        "len_max": lengths[-1], "len_mean": statistics.mean(lengths),
        # The policies drift apart, so equal steps need not mean equal tokens: also per token.
        "ktok_per_s": sum(lengths) / 1000 / sum(hist("timing/step_s")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="tail")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--thresholds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--mode", choices=["keep", "abort", "wait"], default="abort",
                    help="scheduler.update_mode: what a weight update does with running generations")
    ap.add_argument("--pin", action="store_true",
                    help=f"also run each configuration with the trainer on core {DRIVER_CORE}, vLLM on "
                         f"core {ENGINE_CORE}")
    args = ap.parse_args()
    configs = {"sync": ["scheduler=sync"]} | {
        f"async_{k}": ["scheduler=async", f"scheduler.staleness_threshold={k}",
                       f"scheduler.update_mode={args.mode}"] for k in args.thresholds}
    if args.pin:
        configs |= {f"{n}_pin": o for n, o in configs.items()}
    names = list(configs)
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="rlexp-async-bench-") as tmp:
        for rep in range(args.reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                overrides = WORKLOADS[args.workload] + configs[name]
                r = run_one(f"{name}-{rep}", overrides, args.steps, Path(tmp), pin=name.endswith("_pin"))
                results[name].append(r)
                print(f"rep {rep} {name:11s} loop {r['loop_s']:6.1f}s  wall {r['wall_s']:6.1f}s", flush=True)
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    print(f"\nworkload {args.workload}, {args.steps} steps, {args.reps} rep(s), "
          f"update mode {args.mode}; medians; _pin: trainer on core {DRIVER_CORE}, vLLM on core "
          f"{ENGINE_CORE}, otherwise both cores shared")
    cols = ["loop_s", "wall_s", "eval_start", "eval_end", "engine_idle", "trainer_idle", "staleness_mean",
            "staleness_max", "expired", "untrained_tokens", "len_mean", "len_p50", "len_p90", "len_max",
            "ktok_per_s"]
    print("config      " + " ".join(f"{c:>14s}" for c in cols))
    for n in names:
        print(f"{n:11s} " + " ".join(f"{med[n][c]:14.3f}" for c in cols))
    pins = ["", "_pin"] if args.pin else [""]
    for pin in pins:  # each async configuration against sync on the same cores
        sync = med[f"sync{pin}"]
        for k in args.thresholds:
            n = f"async_{k}{pin}"
            print(f"sync{pin}/{n}: training loop {sync['loop_s'] / med[n]['loop_s']:.2f}x, "
                  f"whole run {sync['wall_s'] / med[n]['wall_s']:.2f}x, "
                  f"trained tokens/s {med[n]['ktok_per_s'] / sync['ktok_per_s']:.2f}x")
    # headline: sync / the first async configuration, training loop time, pinned when asked
    pin, k = pins[-1], args.thresholds[0]
    print(f"ratio: {med[f'sync{pin}']['loop_s'] / med[f'async_{k}{pin}']['loop_s']:.3f}")


if __name__ == "__main__":
    main()
