"""A real one-node SLURM on this machine for the launcher tests: scripts/slurm.sh starts munged,
slurmctld and slurmd from Debian's packages (scripts/install_slurm.sh, which `make test` runs)."""

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = ("mungekey", "munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue")
PROCESSES = ("munged", "slurmctld", "slurmscriptd", "slurmd", "slurmstepd")


def processes_left() -> list[str]:
    """`pid name` of every live SLURM or munge process on this machine (an exited daemon may stay
    a zombie until init reaps it: not counted)."""
    ps = subprocess.run(["ps", "-eo", "pid=,stat=,comm="], capture_output=True, text=True, check=True)
    rows = [line.split(None, 2) for line in ps.stdout.splitlines()]
    return [f"{pid} {name}" for pid, stat, name in rows if name in PROCESSES and not stat.startswith("Z")]


def skip_unless_installed() -> None:
    """Skip when SLURM cannot run here; fail instead under CI (CI set, as .ci/run does), where
    `make test` installs it."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    why = (f"SLURM's commands are not on PATH ({', '.join(missing)}): install them as root with "
           "bash scripts/install_slurm.sh (make test runs it)") if missing else None
    if why is None and os.geteuid() != 0:
        why = "the one-node SLURM of scripts/slurm.sh needs root (slurmd starts the jobs)"
    if why and os.environ.get("CI", "").lower() not in ("", "0", "false"):
        pytest.fail(f"CI is set and {why}")
    if why:
        pytest.skip(why)


def _script(action: str, state: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "slurm.sh"), action, str(state)],
                          capture_output=True, text=True, timeout=120)


def run_slurm(state: Path) -> Iterator[dict[str, str]]:
    """Start SLURM with its state in `state`, yield the environment that points the SLURM commands
    at it, then stop it and check that no SLURM or munge process is left."""
    skip_unless_installed()
    assert processes_left() == [], "SLURM or munge is already running here"
    try:
        started = _script("start", state)
        assert started.returncode == 0, started.stderr
        yield dict(os.environ, SLURM_CONF=started.stdout.strip().removeprefix("export SLURM_CONF="))
    finally:
        stopped = _script("stop", state)
        assert stopped.returncode == 0, stopped.stderr
        assert processes_left() == []


def slurm_out(env: dict[str, str], *cmd: str) -> str:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, timeout=60).stdout
