"""A Ray cluster of several nodes on this one host, started the way a cluster is (`ray start`,
once per node): each node has its own raylet, object store and resources, so an object put on
one node crosses into another's store when a task there reads it. The head keeps the host's
address (where a driver started on this host connects) and is given no CPUs, so replicas
and ranks must land on the worker nodes, which listen on other loopback addresses
(127.0.0.2, 127.0.0.3, ...).

A worker node can be started with directories hidden from it (a mount namespace with an
empty tmpfs over each): a node that does not share the file system that holds the model.

Token authentication as Ray's `ray start --head` sets it up by default: every node and
driver uses the token in ~/.ray/auth_token with RAY_AUTH_MODE=token (`env`)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.processes import running_cmdline

VENV_BIN = Path(sys.executable).parent
STARTED = "Ray runtime started"
START_FAILSAFE_S = 120  # turns a node that never comes up into a failure
STOP_GRACE_S = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def can_hide_directories() -> bool:
    """Whether this process may make mount namespaces (root, or a user namespace allowed)."""
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


class RayNodes:
    """`RayNodes(tmp_path).start()`: a head (no CPUs); `add_node(cpus)` per worker node;
    `stop()` takes every node down (`ray start --block` takes its node's processes with it)."""

    def __init__(self, logs: Path, object_store_mb: int = 150):
        import ray

        self.logs, self.object_store_mb = logs, object_store_mb
        logs.mkdir(parents=True, exist_ok=True)
        self.env = os.environ | {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
        subprocess.run([VENV_BIN / "ray", "get-auth-token", "--generate"], env=self.env, check=True,
                       capture_output=True)
        self.head_ip = ray.util.get_node_ip_address()
        self.port, self.dashboard_port = free_port(), free_port()
        self.address = f"{self.head_ip}:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self._procs: list[subprocess.Popen] = []
        self._groups: set[int] = set()  # the process group of every node ever started (killed ones too)
        self._ips: list[str] = []  # each running node's address, the head's as "head"
        self._added = 0  # worker nodes ever added: each gets the next loopback address
        self.cpus = 0  # the cluster's CPUs: the worker nodes'

    def start(self, **config: int) -> RayNodes:
        """`config`: Ray system settings for the head (`health_check_period_ms=500`: how soon
        its GCS notices a node gone), as RAY_<name> in its environment."""
        self._start("head", ["--head", f"--port={self.port}", "--num-cpus=0", "--include-dashboard=true",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}"],
                    env={f"RAY_{k}": str(v) for k, v in config.items()})
        return self

    def add_node(self, cpus: int, hide: tuple[Path, ...] = ()) -> str:
        """A worker node with `cpus` CPUs on the next loopback address (returned), with the
        directories in `hide` empty as it sees them."""
        self._added += 1
        ip = f"127.0.0.{self._added + 1}"
        self.cpus += cpus
        args = [f"--address={self.address}", f"--num-cpus={cpus}", f"--node-ip-address={ip}"]
        mounts = "".join(f'mount -t tmpfs tmpfs "{d}" && ' for d in hide)
        self._start(f"node-{ip}", args, wrap=["unshare", "-m", "sh", "-c", mounts + 'exec "$@"', "sh"] if hide
                    else [])
        return ip

    def kill(self, ip: str) -> None:
        """SIGKILL the node at `ip`: its raylet, object store and every process of its session
        (a node that fails or is preempted)."""
        proc = self._procs.pop(self._ips.index(ip))
        self._ips.remove(ip)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def _start(self, name: str, args: list[str], wrap: list[str] = (),
               env: dict[str, str] | None = None) -> None:
        log = self.logs / f"{name}.log"
        # Each node's dashboard agent listens on a port of its own (Ray's default, 52365, is one
        # per host: a second node's agent fails to bind it, and its raylet exits with it).
        cmd = [*wrap, str(VENV_BIN / "ray"), "start", "--block", "--disable-usage-stats",
               f"--object-store-memory={self.object_store_mb << 20}",
               f"--dashboard-agent-listen-port={free_port()}", *args]
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env | (env or {}),
                                    start_new_session=True)
        self._procs.append(proc)
        self._groups.add(proc.pid)
        self._ips.append(name.removeprefix("node-"))
        deadline = time.monotonic() + START_FAILSAFE_S
        while STARTED not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray node {name} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def __len__(self) -> int:
        return len(self._procs)

    def stop(self) -> list[str]:
        """Worker nodes first, then the head; each `ray start --block` and its processes.
        Returns what is left of them (each node is its own process group)."""
        groups = {proc.pid for proc in self._procs}
        for proc in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:  # the head's dashboard was measured taking 30 s over its SIGTERM: not waited for
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
        self._ips.clear()
        return [cmd for p in psutil.process_iter() if _group(p) in groups and (cmd := running_cmdline(p))]


    def processes(self) -> list[psutil.Process]:
        """The processes of this cluster's nodes, killed nodes' included: those still in the
        process group of a node's `ray start` (each node is one group)."""
        return [p for p in psutil.process_iter() if _group(p) in self._groups]


def _group(p: psutil.Process) -> int | None:
    with contextlib.suppress(psutil.Error, OSError):
        return os.getpgid(p.pid)
    return None
