"""What the benches share: the default experiment's config, model and one step's batch."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

import rlexp.config  # registers the config resolvers

CONF = Path(rlexp.config.__file__).resolve().parents[1] / "conf"  # the checkout whose rlexp runs


def default_config(overrides: list[str] = ()) -> DictConfig:
    """The default experiment's composed config (what `python -m rlexp.run` runs)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def default_model(cfg: DictConfig) -> str:
    return instantiate(cfg.model)  # built once, then cached under ~/.cache/rlexp/models


def one_step_batch(cfg: DictConfig, model_path: str, seed: int = 0):
    """One training step's batch of the default experiment (its prompts, group size,
    sampling and judge), generated with the transformers engine so no vLLM is needed."""
    from transformers import AutoTokenizer

    from rlexp.agents.single_turn import SingleTurnAgent
    from rlexp.data.manager import DataManager
    from rlexp.judges.math_exact import MathExactJudge
    from rlexp.rollout.hf_engine import HFEngine
    from rlexp.schedulers.sync import SyncScheduler

    engine = HFEngine(model_path, seed=seed, temperature=cfg.rollout.temperature,
                      max_response_tokens=cfg.rollout.max_response_tokens)
    agent = SingleTurnAgent(engine, AutoTokenizer.from_pretrained(model_path), MathExactJudge())
    data = DataManager(instantiate(cfg.data.source), cfg.data.prompts_per_step, cfg.data.samples_per_prompt,
                       seed=seed)
    return asyncio.run(SyncScheduler().produce_batch(data, agent, version=0))


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


STEP_METRICS = {"step": "timing/step_s", "produce": "timing/produce_s", "fit": "timing/fit_s",
                "sync": "timing/sync_s", "tokens": "rollout/response_length_mean"}


def rlexp_step_times(overrides: list[str], steps: int, workdir: Path) -> list[dict[str, float]]:
    """Run the rlexp loop in this process for `steps` steps of the experiment `overrides`
    describe (MLflow store and checkpoints under `workdir`, logging as configured: traces on
    unless `overrides` turn them off); per step, what the loop logged (step = produce + fit +
    sync, each phase's seconds, the mean response length) and `whole`: the wall time from the
    loop's log line of the step before to this step's, so the step's MLflow logging and traces
    are in it. The loop runs steps + 1 steps: the first one's log line starts the clock and
    that step is not returned."""
    import logging
    import re

    import mlflow

    from rlexp.config import validate
    from rlexp.loop import RLLoop

    lines: list[float] = []

    class StepLines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if re.match(r"step\s+\d+/\d+", record.getMessage()):
                lines.append(record.created)

    rlexp_log = logging.getLogger("rlexp")  # the loop's, and its modules' through propagation
    rlexp_log.setLevel(logging.INFO)
    rlexp_log.addHandler(StepLines())
    cfg = default_config([f"trainer.total_steps={steps + 1}", f"evaluator.every_n_steps={steps + 1}",
                          "checkpoint.every_n_steps=0", f"logger.tracking_uri=sqlite:///{workdir}/mlflow.db",
                          f"logger.artifact_location={workdir}/artifacts", *overrides])
    validate(cfg)
    asyncio.run(RLLoop(cfg, workdir / "run").execute())
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment_name).experiment_id],
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    history = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
               for name, key in STEP_METRICS.items()}
    records = [{name: history[name][step] for name in STEP_METRICS} for step in sorted(history["step"])][1:]
    return [r | {"whole": t1 - t0} for r, (t0, t1) in zip(records, zip(lines, lines[1:]), strict=True)]


def child_block(cmd: list[str], pss: bool = False) -> list[dict]:
    """Run one block of a bench in a child process (its own engine, nothing shared). The
    child gets `--out PATH` appended and writes its per-step records there as JSON (vLLM
    prints to stdout, so stdout cannot carry them). Each record gets `tree_peak_mb`: the peak
    resident memory of the child's whole process tree over the block (vLLM's engine core is
    a process of its own), sampled every 0.2 s; with `pss`, `tree_peak_pss_mb` the peak of its
    PSS (each shared page counted once, bench/peak_memory.py `tree_memory`) and
    `tree_peak_pss_by_process` the processes' PSS at that moment. PSS is opt-in: it walks each
    process's page tables (~6 ms of CPU for a 2 GB process, every sample), which a bench
    timing steps on a shared 2-core machine should not pay."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    import psutil
    from peak_memory import tree_memory, tree_rss

    with tempfile.NamedTemporaryFile(suffix=".json") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([*cmd, "--out", out.name], stdout=subprocess.DEVNULL, stderr=err, text=True,
                                env=dict(os.environ, HF_HUB_OFFLINE="1"))
        peak, peak_pss, at_peak, tree = 0, 0, [], psutil.Process(proc.pid)
        while proc.poll() is None:
            if pss:
                processes = tree_memory(tree)
                peak = max(peak, sum(rss for _, rss, _ in processes))
                if sum(p for _, _, p in processes) > peak_pss:
                    peak_pss, at_peak = sum(p for _, _, p in processes), processes
            else:
                peak = max(peak, tree_rss(tree))
            time.sleep(0.2)
        if proc.returncode != 0:
            err.seek(0)
            sys.exit(f"block {' '.join(cmd)} failed:\n{err.read()[-4000:]}")
        memory: dict = {"tree_peak_mb": peak / 2**20}
        if pss:
            memory |= {"tree_peak_pss_mb": peak_pss / 2**20, "tree_peak_pss_by_process": ", ".join(
                f"{name} {p / 2**20:.0f}" for name, _, p in at_peak if p > 50 * 2**20)}
        return [step | memory for step in json.loads(Path(out.name).read_text())]


def alternate_blocks(sides: dict[str, list[str]], blocks: int, warmup: int,
                     pss: bool = False) -> dict[str, list[dict]]:
    """Run each side's command `blocks` times, alternating which goes first, so both meet
    the same machine; drop each block's first `warmup` steps. Prints one line per block:
    the median of every field; `pss`: see `child_block`."""
    out: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for b in range(blocks):
        for name in names if b % 2 == 0 else names[::-1]:
            steps = child_block(sides[name], pss)[warmup:]
            out[name] += steps
            fields = "  ".join(f"{k} {median([s[k] for s in steps]):.3f}" if isinstance(v, float | int)
                               else f"{k}: {v}" for k, v in steps[0].items())
            print(f"block {b} {name:<8} {fields}", flush=True)
    return out


def report_sides(runs: dict[str, list[dict]], blocks: int, steps: int) -> dict[str, dict[str, float]]:
    """Print each side's medians (step and its phases, response length, peak RSS if measured)
    over the blocks of `alternate_blocks`; return them by side."""
    print(f"\nmedians over {blocks} blocks x {steps} steps per side:")
    med = {side: {k: median([r[k] for r in recs]) for k, v in recs[0].items() if isinstance(v, float | int)}
           for side, recs in runs.items()}
    for side, m in med.items():
        rss = f"  peak RSS {m['peak_mb']:.0f} MiB" if "peak_mb" in m else ""
        print(f"  {side:6s} step {m['step']:.3f} s  (produce {m['produce']:.3f}  fit {m['fit']:.3f}  "
              f"sync {m['sync']:.3f})  response {m['tokens']:.1f} tokens{rss}")
    return med


def two_sided_args(description: str, sides: list[str]):
    """The command line of a bench that alternates blocks of rlexp steps between `sides`:
    --steps, --blocks, overrides for both; --side/--out are a child block's (one side, its
    per-step records written as JSON to --out)."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=12, help="steps per block (the first 2 untimed)")
    p.add_argument("--blocks", type=int, default=2, help="blocks per side, alternating")
    p.add_argument("overrides", nargs="*", help="config overrides for both sides")
    p.add_argument("--side", choices=sides, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args()


def two_sided_medians(doc: str, script: str, sides: dict[str, list[str]], warmup: int = 2):
    """The whole of a bench whose sides are rlexp runs with their own overrides: in a child
    block (--side), run that side's steps and write their records to --out, returning None;
    else alternate the sides' blocks and return `report_sides`' medians by side."""
    import json
    import sys
    import tempfile

    args = two_sided_args(doc.split("\n")[0], list(sides))
    if args.side:
        with tempfile.TemporaryDirectory() as tmp:
            records = rlexp_step_times([*sides[args.side], *args.overrides], args.steps + warmup, Path(tmp))
        Path(args.out).write_text(json.dumps(records))
        return None
    me = [sys.executable, script, "--steps", str(args.steps), *args.overrides, "--side"]
    runs = alternate_blocks({side: [*me, side] for side in sides}, args.blocks, warmup)
    return report_sides(runs, args.blocks, args.steps)
