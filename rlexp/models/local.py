"""`model=local`: any Hugging Face checkpoint directory on disk (no hub downloads)."""

from __future__ import annotations

from pathlib import Path


def local_model(path: str) -> str:
    p = Path(path).expanduser().resolve()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path}: no config.json there (expected a local "
                                "Hugging Face model directory)")
    return str(p)


def resolve_dtype(dtype: str) -> str:
    """`auto`: bfloat16 where a GPU trains and serves, float32 on a CPU (where bfloat16 matmuls
    are slow and the vLLM-vs-trainer logprob parity is looser)."""
    if dtype != "auto":
        return dtype
    import torch

    return "bfloat16" if torch.cuda.is_available() else "float32"
