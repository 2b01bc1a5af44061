"""Checkpoints: `<run dir>/checkpoints/step_<N>/`, written atomically, the newest `keep_last` kept.

A checkpoint is everything a run needs to continue as if it had never stopped:

    model.safetensors   policy weights  } written by the trainer (`Trainer.save`); the engine
    trainer.pt          optimizer, lr   } is reloaded from the weights on resume
    state.pt            the loop's: step, policy version, data positions, scheduler state
                        (groups waiting or in flight), RNG states, sample-id counter
    meta.json           step, MLflow run id, time; written last

It is assembled in a hidden temporary directory and renamed into place: a crash while
saving leaves the previous checkpoints untouched and a `.tmp-*` directory that the next
save removes. Only directories named `step_<N>` with a `meta.json` count."""

from __future__ import annotations

import io
import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from rlexp.errors import CheckpointError
from rlexp.protocols import Trainer

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"step_(\d+)$")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def serialize(obj) -> bytes:
    """Snapshot now (the async producer keeps mutating live objects); write later."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for d in root.glob("step_*") if root.is_dir() else ():
        m = STEP_DIR.match(d.name)
        if m and (d / "meta.json").is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path:
    found = checkpoints(run_dir)
    if not found:
        raise CheckpointError(f"{run_dir}: no checkpoint (looked for checkpoints/step_<N>/meta.json)")
    return found[-1][1]


def latest_run_dir(search: str | Path) -> Path:
    """`resume=latest`: the run under `search` whose newest checkpoint was written last."""
    candidates = []
    for run_dir in Path(search).glob("*"):
        found = checkpoints(run_dir)
        if found:
            candidates.append(((found[-1][1] / "meta.json").stat().st_mtime, run_dir))
    if not candidates:
        raise CheckpointError(f"resume=latest: no run with a checkpoint under {Path(search).resolve()}")
    return max(candidates)[1]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run_dir: str | Path, step: int, trainer: Trainer, state: bytes, run_id: str | None,
         keep_last: int) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep_last`."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # a save that crashed
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp-step_{step}-{os.getpid()}"
    tmp.mkdir()
    t0 = time.time()
    trainer.save(tmp)
    (tmp / "state.pt").write_bytes(state)
    meta = {"step": step, "mlflow_run_id": run_id, "time": time.time()}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    final = root / f"step_{step}"
    if final.exists():  # saved again at the same step (e.g. stopping right after a regular save)
        shutil.rmtree(final)
    os.rename(tmp, final)  # the commit point
    _fsync_dir(root)
    for _, old in checkpoints(run_dir)[:-keep_last] if keep_last > 0 else ():
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint step %d -> %s (%.2fs)", step, final, time.time() - t0)
    return final


def load(path: str | Path) -> tuple[dict, dict]:
    """A checkpoint's meta.json and the loop's state (the trainer loads its own part)."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    return meta, torch.load(path / "state.pt", map_location="cpu", weights_only=False)
