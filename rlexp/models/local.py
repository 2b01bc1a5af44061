"""`model=local`: any Hugging Face checkpoint directory on disk (no hub downloads)."""

from __future__ import annotations

from pathlib import Path


def local_model(path: str) -> str:
    p = Path(path).expanduser().resolve()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path}: no config.json there (expected a local "
                                "Hugging Face model directory)")
    return str(p)
