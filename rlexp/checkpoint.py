"""A run's directory: its resolved config (`rlexp_config.yaml`, what `resume=` reads back) and
its checkpoints, `checkpoints/step_<N>/`, written atomically, the newest `keep_last` kept.

A checkpoint is everything a run needs to continue as if it had never stopped:

    model.safetensors   policy weights  } written by the trainer (`Trainer.save`); the engine
    trainer.pt          optimizer, lr   } is reloaded from the weights on resume
    state.pt            the loop's `RunState`: step, policy version, data positions and sample
                        numbering, scheduler state (groups waiting or in flight), RNG states
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
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from rlexp.data.manager import DataManager
from rlexp.errors import CheckpointError, ConfigError
from rlexp.protocols import Scheduler, Trainer

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"step_(\d+)$")
RUN_CONFIG = "rlexp_config.yaml"  # a run's resolved config, in its run dir: what `resume=` reads


@dataclass
class RunState:
    """The loop's part of a checkpoint (the trainer writes its own): `capture`d at a checkpoint,
    `read` and restored on resume, so that the run continues as if it had never stopped."""

    step: int  # the last step whose metrics, evaluation and checkpoint are complete
    version: int  # the policy version the engine serves
    data: dict  # the train split's position and sample numbering (DataManager.state_dict)
    eval_data: dict
    scheduler: dict  # groups waiting, in flight or set aside; counts not logged yet
    rng: dict  # python, numpy, torch (and CUDA) generators
    path: Path | None = None  # the checkpoint it was read from
    run_id: str | None = None  # its MLflow run (meta.json)

    @classmethod
    def capture(cls, step: int, version: int, data: DataManager, eval_data: DataManager,
                scheduler: Scheduler) -> RunState:
        return cls(step, version, data.state_dict(), eval_data.state_dict(), scheduler.state_dict(),
                   rng_state())

    def serialize(self) -> bytes:
        """Snapshot now (the async producer keeps mutating live objects); write later."""
        saved = [f.name for f in fields(self) if f.name not in ("path", "run_id")]
        return serialize({name: getattr(self, name) for name in saved})

    @classmethod
    def read(cls, path: str | Path) -> RunState:
        meta, state = load(path)
        return cls(**state, path=Path(path), run_id=meta["mlflow_run_id"])

    def restore_data(self, data: DataManager, eval_data: DataManager) -> None:
        """Positions in both splits; cheap, and before any engine starts: a dataset that
        changed since the checkpoint is a config error."""
        try:
            data.load_state_dict(self.data)
            eval_data.load_state_dict(self.eval_data)
        except ValueError as e:
            raise ConfigError(f"resume from {self.path}: {e}") from e

    def restore(self, scheduler: Scheduler) -> None:
        """The scheduler's groups and counts, then the RNGs: last, once everything built since
        the start has drawn from them."""
        scheduler.load_state_dict(self.scheduler)
        set_rng_state(self.rng)


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


def find_run(resume: str, search: str | Path) -> tuple[Path, Path]:
    """`resume=<run dir>` or `resume=latest` (the run under `search` checkpointed last): the
    run's dir (its config is `RUN_CONFIG` there) and its newest checkpoint."""
    run_dir = latest_run_dir(search) if resume == "latest" else Path(resume)
    if not (run_dir / RUN_CONFIG).is_file():
        raise CheckpointError(f"resume={resume}: {run_dir / RUN_CONFIG} not found (not an rlexp run dir?)")
    return run_dir, latest_checkpoint(run_dir)


def save_run_config(run_dir: str | Path, cfg: DictConfig) -> None:
    """The resolved config, for `find_run` and `resume=` to read back."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, Path(run_dir) / RUN_CONFIG, resolve=True)


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
