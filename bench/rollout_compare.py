"""rlexp's rollout throughput, this checkout against another: run it before and after a change
to the engine path.

    git clone -q . /tmp/before && git -C /tmp/before checkout <commit>
    .venv/bin/python bench/rollout_compare.py --before /tmp/before [--rounds 3 --reps 10]

Each round runs this checkout's bench/rollout_overhead.py twice, once importing this
checkout's rlexp and once the other's (`PYTHONPATH`; same venv and harness, each tree's conf),
alternating which goes first. Each run's figure is rlexp's tokens/s over raw vLLM's in that
same process, on the same requests, so how fast the machine was during a run cancels out.
The headline is after over before of the medians of those figures: above 1, this checkout's
rollout path is faster.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def overhead(checkout: Path, reps: int, batches: int) -> float:
    """rlexp / raw vLLM from one bench/rollout_overhead.py run against `checkout`'s rlexp."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(HERE / "bench" / "rollout_overhead.py"), "--reps", str(reps),
                          "--batches", str(batches)], cwd=HERE, env=env, capture_output=True, text=True,
                         timeout=1800)
    found = re.findall(r"^ratio: ([\d.]+)$", out.stdout, re.M)
    assert out.returncode == 0 and found, f"{checkout}: the bench failed\n{out.stderr[-3000:]}"
    return float(found[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=10, help="repetitions per bench run")
    parser.add_argument("--batches", type=int, default=4, help="batches per repetition")
    args = parser.parse_args()
    sides = {"after": HERE, "before": args.before.resolve()}
    ratios: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(args.rounds):
        for side, checkout in (list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]):
            ratios[side].append(overhead(checkout, args.reps, args.batches))
            print(f"round {r} {side:>6}: rlexp / raw vLLM {ratios[side][-1]:.3f}", flush=True)
    med = {side: statistics.median(v) for side, v in ratios.items()}
    print(f"medians: after {med['after']:.3f}, before {med['before']:.3f} (rlexp / raw vLLM)")
    print(f"ratio: {med['after'] / med['before']:.3f}")


if __name__ == "__main__":
    main()
