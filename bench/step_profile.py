"""Where rlexp's step spends the time the naive loop's does not: bench/step_vs_naive.py's two
sides, each sampled (bench/stack_sampler.py), as one table of milliseconds per step.

    .venv/bin/python bench/step_profile.py [--steps 12 --interval 0.004 --flame DIR]

Each side runs in its own process, as in bench/step_vs_naive.py: the naive single-file loop
and rlexp's `RLLoop` on the default experiment, 2 warm-up steps, then `--steps` timed ones.
A sampler thread in each process gives every few milliseconds of a timed step to a cell
(phase, category): the phase of the step (produce, fit, sync, log = everything after the sync
until the next step: metrics, traces, the log line) and what the step's thread was doing (its
innermost library: torch, vLLM's output processing, the judge, MLflow, asyncio, ...; `idle`
when no thread of the driver process works, which is waiting on vLLM's engine core). The cells
of a side add up to its timed steps' wall time; the table is per step, both sides and their
difference, largest first. Below it: the engine processes' CPU per phase (their busy share of
it) and the thread-seconds other threads of the driver worked beside the step's thread.

The coverage check: the table's difference over the difference of the sides' own step
timers (the naive loop's whole step, rlexp's log line to log line), printed last as `ratio:`.

`--flame DIR` also runs each side under `py-spy record --idle --subprocesses` and writes
DIR/naive.svg and DIR/rlexp.svg (flame graphs of every process of the side).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WARMUP = 2
PHASES = ("produce", "fit", "sync", "log")


class PhaseClock:
    """Stands in for rlexp/step.py's `time` module: `rl_step` calls `time.time()` four times a
    step (before produce, after produce, after fit, after sync), so the calls mark the phases;
    the fourth's phase (log) lasts until the next step's first call. Steps outside
    [warmup, warmup + steps) are not timed."""

    def __init__(self, sampler, warmup: int, steps: int):
        self.sampler, self.warmup, self.steps, self.calls = sampler, warmup, steps, 0

    def time(self) -> float:
        step, i = divmod(self.calls, len(PHASES))
        self.calls += 1
        self.sampler.phase(PHASES[i] if self.warmup <= step < self.warmup + self.steps else None)
        return time.time()


def profile_side(side: str, steps: int, interval: float) -> dict:
    """One side's cells, its CPU beside and its children's, and its own timers' mean step."""
    from stack_sampler import StackSampler

    sampler = StackSampler(interval)
    sampler.start()
    if side == "naive":
        from step_vs_naive import naive_steps

        def mark(step: int, phase: str) -> None:
            sampler.phase(phase if WARMUP < step <= WARMUP + steps else None)

        records = naive_steps(WARMUP + steps + 1, mark)[WARMUP:WARMUP + steps]
    else:
        from common import rlexp_step_times

        import rlexp.step

        rlexp.step.time = PhaseClock(sampler, WARMUP, steps)  # type: ignore[assignment]
        with tempfile.TemporaryDirectory() as tmp:  # records of loop steps 2 .., timed: WARMUP + 1 ..
            records = rlexp_step_times([], WARMUP + steps, Path(tmp))[WARMUP - 1:WARMUP - 1 + steps]
    sampler.stop()
    cells: dict[str, dict[str, float]] = defaultdict(dict)
    for (phase, cat), seconds in sampler.cells.items():
        cells[phase][cat] = seconds / steps
    sites: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for (phase, cat, site), seconds in sorted(sampler.sites.items(), key=lambda kv: -kv[1]):
        sites[f"{phase} {cat}"].append((site, seconds / steps))
    return {"cells": cells, "sites": sites, "beside": {k: v / steps for k, v in sampler.beside.items()},
            "children_cpu": {k: v / steps for k, v in sampler.children_cpu.items()},
            "whole": sum(r["whole"] for r in records) / len(records), "samples": sampler.samples}


def run_side(side: str, args, flame: Path | None) -> dict:
    """A side in a child process (its own engine), under py-spy when `flame` is a folder."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--side", side, "--steps", str(args.steps),
               "--interval", str(args.interval), "--out", out.name]
        if flame is not None:
            spy = Path(sys.executable).with_name("py-spy")
            cmd = [str(spy), "record", "--idle", "--subprocesses", "--rate", "50", "--format", "flamegraph",
                   "--output", str(flame / f"{side}.svg"), "--", *cmd]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def table(sides: dict[str, dict], sites: bool) -> float:
    """Print the cells per step, both sides and the difference, largest first (with `sites`:
    under each row, its 3 largest sites on each side); return the table's difference (rlexp -
    naive) in seconds."""
    naive, ours = sides["naive"]["cells"], sides["rlexp"]["cells"]
    rows = []
    for phase in PHASES:
        for cat in sorted(set(naive.get(phase, {})) | set(ours.get(phase, {}))):
            a, b = naive.get(phase, {}).get(cat, 0.0), ours.get(phase, {}).get(cat, 0.0)
            rows.append((b - a, phase, cat, a, b))
    print(f"{'phase':8s} {'category':28s} {'naive ms':>9s} {'rlexp ms':>9s} {'rlexp-naive':>12s}")
    for diff, phase, cat, a, b in sorted(rows, key=lambda r: -abs(r[0])):
        if max(a, b) >= 0.0005:
            print(f"{phase:8s} {cat:28s} {a * 1e3:9.1f} {b * 1e3:9.1f} {diff * 1e3:+12.1f}")
            if sites:
                for name, side in sides.items():
                    top = [f"{site} {t * 1e3:.1f}" for site, t in side["sites"].get(f"{phase} {cat}", [])[:3]
                           if site and t >= 0.0005]
                    if top:
                        print(f"{'':37s} {name}: {'; '.join(top)}")
    total_a, total_b = (sum(sum(c.values()) for c in side.values()) for side in (naive, ours))
    print(f"{'all':8s} {'(one step)':28s} {total_a * 1e3:9.1f} {total_b * 1e3:9.1f} "
          f"{(total_b - total_a) * 1e3:+12.1f}")
    for phase in PHASES:
        line = []
        for name, side in sides.items():
            wall, cpu = sum(side["cells"].get(phase, {}).values()), side["children_cpu"].get(phase, 0.0)
            line.append(f"{name} {cpu * 1e3:6.1f} ms ({cpu / max(wall, 1e-9):.0%} of the phase)")
        print(f"engine processes' CPU in {phase:8s}: {', '.join(line)}")
    for name, side in sides.items():
        beside = sorted(side["beside"].items(), key=lambda kv: -kv[1])
        listed = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in beside) or "none"
        print(f"{name}: driver threads working beside the step's thread, ms per step: {listed}")
    return total_b - total_a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps per side (after 2 warm-up steps)")
    p.add_argument("--interval", type=float, default=0.004, help="seconds between stack samples")
    p.add_argument("--sites", action="store_true", help="under each row, where in the code (3 largest)")
    p.add_argument("--flame", type=Path, help="also write py-spy flame graphs of each side here")
    p.add_argument("--side", choices=["naive", "rlexp"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        Path(args.out).write_text(json.dumps(profile_side(args.side, args.steps, args.interval)))
        return
    if args.flame:
        args.flame.mkdir(parents=True, exist_ok=True)
    sides = {side: run_side(side, args, None) for side in ("naive", "rlexp")}
    diff = table(sides, args.sites)
    measured = sides["rlexp"]["whole"] - sides["naive"]["whole"]
    naive, ours = sides["naive"]["whole"], sides["rlexp"]["whole"]
    samples = sides["naive"]["samples"] + sides["rlexp"]["samples"]
    print(f"own timers, mean whole step: naive {naive:.3f} s, rlexp {ours:.3f} s ({ours / naive:.3f}x); "
          f"difference {measured * 1e3:+.1f} ms, the table's {diff * 1e3:+.1f} ms ({samples} samples)")
    if args.flame:
        for side in ("naive", "rlexp"):
            run_side(side, args, args.flame)
        print(f"flame graphs: {args.flame}/naive.svg, {args.flame}/rlexp.svg")
    print(f"ratio: {diff / measured:.3f}")


if __name__ == "__main__":
    main()
