"""Sync vs async scheduling, at each staleness threshold in each weight-update mode, on the same
workload and the same number of steps, side by side in one invocation.

    .venv/bin/python bench/async_speedup.py [--workload tail|multiturn] [--steps 30]
                                            [--thresholds 1 2] [--modes keep abort wait]
                                            [--reps 1] [--pin | --pinned-only]

`--mode M` is the same as `--modes M`. Configurations: `sync`, and `async_<mode>_<threshold>`
for each of --modes (scheduler.update_mode: what the vLLM engine does with its running
generations at a weight update; keep: paused with their KV cache and resumed, abort: cut
short and sent again, prompt and tokens so far prefilled again, wait: let finish) and each of
--thresholds (scheduler.staleness_threshold). Each is a real `python -m rlexp.run` (vLLM, GRPO
trainer, MLflow) with the same seed and workload; only `scheduler...` differs. Workloads:
  tail       long-tailed response lengths: the tiny model warm-started for only 10 steps,
             so most answers are short but some ramble (p50 ~5, p90 ~17 tokens, up to 64);
             it barely knows arithmetic, so accuracy says little here: this one measures time
  multiturn  the default tiny model with agent=multiturn: 1 to 3 replies per trajectory,
             and it learns (accuracy rises within a few dozen steps)
Reported per configuration, read back from each run's MLflow store (bench/async_report.py):
training-loop wall time (sum of `timing/step_s`: produce + fit + sync, no engine start-up, no
evaluation), whole-process wall time, eval accuracy before and after, mean rollout-engine and
trainer idle fractions, staleness, expired samples, tokens generated but never trained,
response-length percentiles, trained ktokens/s; and in a second table the weight updates'
cost: updates (steps that logged `rollout/update_pause_s`: every async step, never sync's),
pause seconds per update (mean of `rollout/update_pause_s`), tokens prefilled again (sum of
`rollout/prefilled_again_tokens`) in all and per update, `rollout/mixed_tokens` in all, and
the engine idle fraction again. Ratios are sync / async (> 1: async is faster), each within
one core setting. With --reps > 1 the configurations run in rotating order and the median per
configuration is reported.

Printed last: which configuration the headline is, whether every keep-mode run prefilled 0
tokens again, then `ratio: X`: sync's training-loop time / that of the fastest async
configuration (smallest median `loop_s`, over every mode and threshold), on shared cores, or
both pinned with --pin.

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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"  # before mlflow is imported

import async_report as report

ROOT = Path(__file__).resolve().parents[1]
DRIVER_CORE, ENGINE_CORE = 0, 1
PIN_ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(ENGINE_CORE)}
MODES = ("keep", "abort", "wait")  # scheduler.update_mode
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
    """One `python -m rlexp.run` of `steps` steps with `overrides` (MLflow store and outputs
    under `workdir`), pinned with `pin`; its numbers (bench/async_report.py `read_run`)."""
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
    return report.read_run(uri, steps, wall)


def configurations(thresholds: list[int], modes: list[str], pins: list[str]) -> dict[str, list[str]]:
    """The configurations by name: `sync`, then `async_<mode>_<threshold>` for each update mode
    and staleness threshold, each with each suffix of `pins` ("": shared cores, "_pin": pinned)."""
    configs = {"sync": ["scheduler=sync"]} | {
        f"async_{mode}_{k}": ["scheduler=async", f"scheduler.staleness_threshold={k}",
                              f"scheduler.update_mode={mode}"] for mode in modes for k in thresholds}
    return {f"{n}{pin}": o for pin in pins for n, o in configs.items()}


def run_all(configs: dict[str, list[str]], workload: str, steps: int, reps: int) -> dict[str, list[dict]]:
    """Every configuration `reps` times, each repetition starting one configuration later (rotating
    order), in a temporary folder; each run's numbers by configuration."""
    names = list(configs)
    width = max(map(len, names))
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="rlexp-async-bench-") as tmp:
        for rep in range(reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                overrides = WORKLOADS[workload] + configs[name]
                r = run_one(f"{name}-{rep}", overrides, steps, Path(tmp), pin=name.endswith("_pin"))
                results[name].append(r)
                print(f"rep {rep} {name:{width}s} loop {r['loop_s']:6.1f}s  wall {r['wall_s']:6.1f}s",
                      flush=True)
    return results


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=list(WORKLOADS), default="tail")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--thresholds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", choices=MODES, nargs="+", default=list(MODES),
                    help="scheduler.update_mode values to run: what a weight update does with running "
                         "generations (each with every threshold)")
    ap.add_argument("--mode", choices=MODES, help="one update mode: the same as --modes MODE")
    ap.add_argument("--pin", action="store_true",
                    help=f"also run each configuration with the trainer on core {DRIVER_CORE}, vLLM on "
                         f"core {ENGINE_CORE}")
    ap.add_argument("--pinned-only", action="store_true", help="only the pinned runs (implies --pin)")
    args = ap.parse_args()
    args.pin = args.pin or args.pinned_only
    if args.mode:
        args.modes = [args.mode]
    return args


def main() -> None:
    args = parse_args()
    pins = ["_pin"] if args.pinned_only else ["", "_pin"] if args.pin else [""]
    configs = configurations(args.thresholds, args.modes, pins)
    results = run_all(configs, args.workload, args.steps, args.reps)
    med = report.medians(results)
    print(f"\nworkload {args.workload}, {args.steps} steps, {args.reps} rep(s), update modes "
          f"{' '.join(args.modes)}; medians; _pin: trainer on core {DRIVER_CORE}, vLLM on core "
          f"{ENGINE_CORE}, otherwise both cores shared")
    report.print_table("time, accuracy, idle, staleness, lengths:", med, report.MAIN_COLUMNS)
    report.print_table("weight updates (an update: a step that logged rollout/update_pause_s; sync has "
                       "none, so '-' per update):", med, report.UPDATE_COLUMNS)
    report.print_ratios(med, pins)
    report.print_headline(med, results, pins[-1])


if __name__ == "__main__":
    main()
