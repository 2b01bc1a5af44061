"""Seconds from `python -m rlexp.run <bad input>` to its one-line error, this checkout
against another (e.g. a clone of an older commit), alternating, same machine and venv.

    git clone -q . /tmp/before && git -C /tmp/before checkout <commit>
    .venv/bin/python bench/time_to_error.py --before /tmp/before [--reps 3]

Bad inputs: a data file with an invalid line, an option no component takes, a `_target_`
that does not exist. The ratio is before/after of the summed medians (how many times
faster the errors come in this checkout). Without --before it prints the seconds only: a ratio
is always two checkouts doing the same work side by side.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
BAD_INPUTS = {
    "bad data file": ["data=jsonl", "data.source.train_path={tmp}/bad.jsonl"],
    "unknown option": ["+trainer.no_such_knob=1"],
    "bad _target_": ["agent._target_=rlexp.agents.nope.Agent"],
}


def time_to_error(checkout: Path, overrides: list[str]) -> tuple[float, str]:
    """Run in `checkout` (python -m puts it first on sys.path), so its rlexp is the one imported."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "rlexp.run", *overrides], cwd=checkout, capture_output=True,
                         text=True, timeout=600)
    seconds = time.perf_counter() - t0
    assert out.returncode == 2, f"expected a config error (exit 2) in {checkout}:\n{out.stderr[-1500:]}"
    return seconds, out.stderr.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", type=Path, help="another checkout to time side by side")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    sides = {"after": HERE} | ({"before": args.before.resolve()} if args.before else {})
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "bad.jsonl").write_text('{"question": "1+1=", "answer": "#### 2"}\nnot json\n')
        times: dict[tuple[str, str], list[float]] = {}
        for rep in range(args.reps):
            for case, overrides in BAD_INPUTS.items():
                order = list(sides.items()) if rep % 2 == 0 else list(sides.items())[::-1]
                for side, checkout in order:
                    seconds, error = time_to_error(checkout, [o.format(tmp=tmp) for o in overrides])
                    times.setdefault((case, side), []).append(seconds)
                    if rep == 0:
                        print(f"{case} ({side}): {error}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for case in BAD_INPUTS:
        print(f"{case:>15}: " + "  ".join(f"{side} {med[case, side]:.2f} s" for side in sides))
    if "before" in sides:
        before = sum(med[c, "before"] for c in BAD_INPUTS)
        after = sum(med[c, "after"] for c in BAD_INPUTS)
        print(f"ratio: {before / after:.2f}")
    else:
        print("no ratio: pass --before <another checkout> to compare side by side")


if __name__ == "__main__":
    main()
