"""Rollout routing replay's cost on a step: experiment=moe (capture in the engine, replay in
every training forward) over the same experiment with neither, in one run.

    .venv/bin/python bench/routing_replay.py [--steps 12 --blocks 2] [overrides applied to both ...]

Each side is rlexp's own loop (`RLLoop`, vLLM, MLflow) in its own process, from the same seed,
model and data. Blocks alternate the sides so both meet the same machine; the first 2 steps of
each block are warm-up. What replay adds: in the engine, the routers' capture hook, one
call per request to fetch its routing, and prefix caching off (CPU); in the trainer, a hook
per MoE layer that takes the softmax at the given experts. Headline: median step with
capture and replay / median step with neither."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WARMUP = 2
SIDES = {"none": ["experiment=moe", "trainer.routing_replay=none", "rollout.routing_capture=false"],
         "replay": ["experiment=moe"]}


def main() -> None:
    from common import two_sided_medians

    med = two_sided_medians(__doc__, __file__, SIDES, WARMUP)
    if med is None:  # a child block
        return
    n, r = med["none"], med["replay"]
    print(f"produce replay/none: {r['produce'] / n['produce']:.3f}   "
          f"fit replay/none: {r['fit'] / n['fit']:.3f}")
    print(f"ratio: {r['step'] / n['step']:.3f}")


if __name__ == "__main__":
    main()
