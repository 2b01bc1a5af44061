"""`model=local`: a Hugging Face checkpoint directory on disk, or a hub id (`org/name`) resolved
once, on the driver, to its snapshot in the hub cache (rlexp/data/hub.py); every process gets
the local directory."""

from __future__ import annotations

from pathlib import Path

from rlexp.data.hub import resolve
from rlexp.errors import ConfigError


def local_model(path: str, revision: str | None = None) -> str:
    """The model directory: `path` if it is a local directory (it wins over a hub id), else the
    local snapshot of the hub id `path` at `revision` (a branch, tag or commit; None: main),
    downloaded into the hub cache unless it is there already (never with HF_HUB_OFFLINE=1)."""
    p = Path(resolve(path, revision, "model", "model.path", "model.revision").path).expanduser().resolve()
    if not (p / "config.json").is_file():
        raise ConfigError(f"model.path={path}: no config.json there (expected a local Hugging Face "
                          "model directory, or a hub id org/name)")
    return str(p)


def resolve_dtype(dtype: str) -> str:
    """`auto`: bfloat16 where a GPU trains and serves, float32 on a CPU (where bfloat16 matmuls
    are slow and the vLLM-vs-trainer logprob parity is looser)."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"
