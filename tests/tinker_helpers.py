"""What the Tinker API tests share: the server (`python -m rlexp.tinker`) as a child process,
and client scripts run by the real `tinker` SDK in its own venv (.venv-tinker, `make envs`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY_KW

ROOT = Path(__file__).resolve().parents[1]
TINKER_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
BASE_MODEL = "rlexp/tiny-chat"
START_TIMEOUT_S = 900  # the engine's start on a loaded machine
# The suite's tiny model (tests/conftest.py's TINY_KW: a short warm-start), the one the
# `tiny_model_path` fixture builds into the session's RLEXP_CACHE: the server finds it there.
TINY = [f"model.{k}={v!r}" if isinstance(v, str) else f"model.{k}={v}" for k, v in TINY_KW.items()]


def require_sdk() -> None:
    if not TINKER_PYTHON.exists():
        pytest.fail(f"{TINKER_PYTHON} is missing: `make envs` creates it (the tinker SDK's own venv)")


class Server:
    """`python -m rlexp.tinker` on a free loopback port, its state and MLflow store under `root`."""

    def __init__(self, root: Path, *overrides: str):
        self.root, self.overrides = root, overrides
        self.proc: subprocess.Popen | None = None
        self.url = ""

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.root / 'mlflow.db'}"

    def start(self) -> Server:
        log = open(self.root / "server.log", "a")
        cmd = [sys.executable, "-m", "rlexp.tinker", "tinker.port=0", f"tinker.state_dir={self.state}",
               f"logger.tracking_uri={self.tracking_uri}", f"logger.artifact_location={self.root / 'art'}",
               f"hydra.run.dir={self.root / 'hydra'}", *TINY, *self.overrides]
        self.proc = subprocess.Popen(cmd, cwd=self.root, stdout=subprocess.PIPE, stderr=log, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("rlexp tinker: serving"):
                self.url = line.split(" on ")[1].split()[0]
                return self
            if time.monotonic() > deadline:
                break
        self.stop()
        log_tail = (self.root / "server.log").read_text()[-3000:]
        raise RuntimeError(f"the Tinker server did not start: {log_tail}")

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs (a crashed server)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


def sdk(server: Server, script: str, *args: str, timeout: float = 600) -> dict:
    """Run `script` with the tinker SDK's Python (`URL` and `ARGS` defined for it); the JSON
    object it prints last."""
    require_sdk()
    path = server.root / f"client_{abs(hash(script))}.py"
    prelude = ("import json, sys\nimport tinker\nfrom tinker import types\n"
               "URL, ARGS = sys.argv[1], sys.argv[2:]\n"
               "service = tinker.ServiceClient(base_url=URL)\n")
    # Out once its output is: the SDK's event loop runs on a daemon thread, and the interpreter's
    # teardown beside it (torch loaded) has crashed under load after a script's work was done
    # (status non-zero, output complete and flushed by that teardown, no traceback).
    epilogue = "\nsys.stdout.flush()\nsys.stderr.flush()\nimport os\nos._exit(0)\n"
    path.write_text(prelude + script + epilogue)
    env = os.environ | {"TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HUB_OFFLINE": "1",
                        "PYTHONFAULTHANDLER": "1"}  # a crash prints its threads' stacks
    out = subprocess.run([str(TINKER_PYTHON), str(path), server.url, *args], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=server.root)
    assert out.returncode == 0, (f"SDK client exited {out.returncode}:\n{out.stdout[-3000:]}\n"
                                 f"{out.stderr[-6000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
