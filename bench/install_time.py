"""Seconds to install the pinned CPU package set (requirements/cpu.txt) into a new venv with pip
and with uv (what scripts/install.sh uses), side by side, each with an empty download cache.

    .venv/bin/python bench/install_time.py [--reps 1] [--lock requirements/cpu.txt]

Both install the same lock from the same indexes (pip's configuration; uv gets it as flags from
scripts/pins.py). The ratio is pip's median seconds over uv's.
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


def _uv_version(lock: Path) -> str:
    pins = dict(line.split("==", 1) for line in lock.read_text().splitlines() if "==" in line)
    return pins["uv"].strip()


def install(tool: str, lock: Path, work: Path) -> float:
    """Seconds from an empty venv to the lock installed in it."""
    venv, cache = work / "venv", work / "cache"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py, uv = str(venv / "bin" / "python"), str(venv / "bin" / "uv")
    pip = [py, "-m", "pip", "install", "-q"]
    t0 = time.perf_counter()
    if tool == "uv":  # installing uv itself is part of it
        subprocess.run([*pip, "--no-cache-dir", f"uv=={_uv_version(lock)}"], check=True)
        indexes = subprocess.run([py, str(HERE / "scripts/pins.py"), "index-args", "cpu"], check=True,
                                 capture_output=True, text=True).stdout.split()
        # --compile-bytecode as scripts/install.sh: pip writes .pyc files too
        sync = [uv, "pip", "sync", "-q", "--compile-bytecode", "--python", py, "--cache-dir", str(cache)]
        subprocess.run([*sync, *indexes, str(lock)], check=True)
    else:
        subprocess.run([*pip, "--cache-dir", str(cache), "-r", str(lock)], check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--lock", type=Path, default=HERE / "requirements/cpu.txt")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"pip": [], "uv": []}
    for rep in range(args.reps):
        for tool in ("pip", "uv") if rep % 2 == 0 else ("uv", "pip"):
            with tempfile.TemporaryDirectory(prefix=f"rlexp-install-{tool}-") as work:
                times[tool].append(install(tool, args.lock, Path(work)))
            print(f"{tool:4s} rep {rep}: {times[tool][-1]:.1f} s", flush=True)
    pip_s, uv_s = statistics.median(times["pip"]), statistics.median(times["uv"])
    print(f"{len(args.lock.read_text().splitlines())} lines in {args.lock.name}; median pip {pip_s:.1f} s, "
          f"uv {uv_s:.1f} s")
    print(f"ratio: {pip_s / uv_s:.2f}")


if __name__ == "__main__":
    main()
