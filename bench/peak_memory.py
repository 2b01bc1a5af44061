"""Run a command and report the peak resident memory of its whole process tree.

    .venv/bin/python bench/peak_memory.py -- .venv/bin/python -m rlexp.run

Samples the summed RSS of the command and all its descendants every --interval seconds
(vLLM runs its engine core in child processes, so the parent's own RSS is not enough).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def tree_memory(proc: psutil.Process) -> list[tuple[str, int, int]]:
    """(name, RSS, PSS) of the process and each descendant. RSS counts a page shared by two
    processes (a library, a mapped file, /dev/shm) in both; PSS gives each sharer its share,
    so the tree's PSS adds up to the memory it holds."""
    out = []
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
            out.append((p.name(), info.rss, info.pss))
        except psutil.Error:
            pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    t0 = time.time()
    child = subprocess.Popen(cmd)
    proc, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            peak = max(peak, tree_rss(proc))
        except psutil.Error:
            pass
        time.sleep(args.interval)
    print(f"peak_memory: {peak / 2**30:.2f} GiB (RSS of the process tree)  wall: {time.time() - t0:.0f}s"
          f"  exit: {child.returncode}", file=sys.stderr)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
