"""A run's trained policy as a model directory that transformers and vLLM load (for instance
as on-policy distillation's teacher: teacher=local teacher.model_path=<out>):

    python -m rlexp.export <run dir> <out dir> [--step N]      # N: its newest checkpoint by default

The directory is the run's model directory (config, tokenizer, chat template; the path the run
resolved, rebuilt if the model is built locally and not cached) with the checkpoint's weights
(`model.safetensors`, LoRA already merged into it)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import OmegaConf

from rlexp.checkpoint import RUN_CONFIG, checkpoints
from rlexp.errors import CheckpointError, config_error_unwrapped
from rlexp.weights.files import WEIGHTS_FILE


def export(run_dir: Path, out: Path, step: int | None = None) -> Path:
    """Write the policy of `run_dir`'s checkpoint at `step` (None: the newest) into `out`."""
    found = dict(checkpoints(run_dir))
    if not found or (step is not None and step not in found):
        raise CheckpointError(f"{run_dir}: no checkpoint {'at step ' + str(step) if step else ''} "
                              f"(found steps {sorted(found)})")
    checkpoint = found[step if step is not None else max(found)]
    cfg = OmegaConf.load(run_dir / RUN_CONFIG)
    with config_error_unwrapped():
        model_dir = Path(instantiate(cfg.model))
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    shutil.copy2(checkpoint / WEIGHTS_FILE, out / "model.safetensors")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rlexp.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--step", type=int, default=None)
    args = parser.parse_args(argv)
    print(export(args.run_dir, args.out, args.step))


if __name__ == "__main__":
    main()
