"""Where the Tinker server keeps what outlives a process: per training model a directory
under `state_dir/runs/<model id>/` with `meta.json` (base model, LoRA, user metadata, its
checkpoints) and the checkpoints themselves (`weights/<name>/`: the whole training state;
`sampler_weights/<name>/`: the merged weights the engine loads). A restarted server finds
them there: `tinker://` paths saved before the restart load after it."""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rlexp.tinker.errors import BadRequest, not_found

KINDS = {"weights": "training", "sampler_weights": "sampler"}


class Store:
    def __init__(self, state_dir: Path):
        self.root = state_dir / "runs"
        self.root.mkdir(parents=True, exist_ok=True)

    def run_dir(self, model_id: str) -> Path:
        if "/" in model_id or model_id in (".", ".."):
            raise BadRequest(f"model id {model_id!r} cannot name a run", "model_id")
        return self.root / model_id

    def create(self, model_id: str, meta: dict[str, Any]) -> None:
        d = self.run_dir(model_id)
        d.mkdir(parents=True, exist_ok=True)
        self._write(model_id, meta | {"checkpoints": [], "created": _now()})

    def meta(self, model_id: str) -> dict[str, Any]:
        f = self.run_dir(model_id) / "meta.json"
        if not f.exists():
            raise not_found("training run", model_id, "model_id")
        return json.loads(f.read_text())

    def checkpoint_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.run_dir(model_id) / kind / name

    def saved(self, model_id: str, kind: str, name: str, seconds_to_live: int | None) -> str:
        """Record a written checkpoint; its tinker:// path."""
        meta = self.meta(model_id)
        path = f"tinker://{model_id}/{kind}/{name}"
        entry = {"checkpoint_id": f"{kind}/{name}", "checkpoint_type": KINDS[kind], "time": _now(),
                 "tinker_path": path, "size_bytes": _size(self.checkpoint_dir(model_id, kind, name)),
                 "public": False, "expires_at": None if seconds_to_live is None else _later(seconds_to_live)}
        meta["checkpoints"] = [c for c in meta["checkpoints"] if c["tinker_path"] != path] + [entry]
        self._write(model_id, meta)
        return path

    def existing(self, model_id: str, kind: str, name: str, where: str = "path") -> Path:
        d = self.checkpoint_dir(model_id, kind, name)
        if not d.is_dir():
            raise not_found("checkpoint", f"tinker://{model_id}/{kind}/{name}", where)
        return d

    def delete(self, model_id: str, kind: str, name: str) -> None:
        shutil.rmtree(self.existing(model_id, kind, name))
        meta = self.meta(model_id)
        meta["checkpoints"] = [c for c in meta["checkpoints"] if c["checkpoint_id"] != f"{kind}/{name}"]
        self._write(model_id, meta)

    def training_run(self, model_id: str) -> dict[str, Any]:
        """The SDK's TrainingRun of a model."""
        meta = self.meta(model_id)
        last = {kind: next((c for c in reversed(meta["checkpoints"]) if c["checkpoint_type"] == kind), None)
                for kind in KINDS.values()}
        return {"training_run_id": model_id, "base_model": meta["base_model"], "model_owner": "local",
                "is_lora": meta["lora_rank"] > 0, "corrupted": False, "lora_rank": meta["lora_rank"] or None,
                "last_request_time": meta.get("last_request_time", meta["created"]),
                "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
                "user_metadata": {k: str(v) for k, v in (meta.get("user_metadata") or {}).items()}}

    def runs(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob("*/meta.json"))

    def record(self, model_id: str, **fields: Any) -> None:
        """Add `fields` to the model's meta.json."""
        self._write(model_id, self.meta(model_id) | fields)

    def touch(self, model_id: str) -> None:
        meta = self.meta(model_id)
        meta["last_request_time"] = _now()
        self._write(model_id, meta)

    def _write(self, model_id: str, meta: dict[str, Any]) -> None:
        f = self.run_dir(model_id) / "meta.json"
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=1))
        tmp.replace(f)  # a killed server leaves the old file or the new one, never half of one


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _later(seconds: int) -> str:
    return datetime.fromtimestamp(time.time() + seconds, timezone.utc).isoformat()


def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
