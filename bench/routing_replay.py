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

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WARMUP = 2
SIDES = {"none": ["experiment=moe", "trainer.routing_replay=none", "rollout.routing_capture=false"],
         "replay": ["experiment=moe"]}


def main() -> None:
    from common import two_sided_args

    args = two_sided_args(__doc__.split("\n")[0], list(SIDES))
    from common import alternate_blocks, report_sides, rlexp_step_times

    if args.side:  # one block, in a child process: its per-step records as JSON into --out
        with tempfile.TemporaryDirectory() as tmp:
            records = rlexp_step_times([*SIDES[args.side], *args.overrides], args.steps + WARMUP, Path(tmp))
        Path(args.out).write_text(json.dumps(records))
        return
    me = [sys.executable, __file__, "--steps", str(args.steps), *args.overrides, "--side"]
    runs = alternate_blocks({side: [*me, side] for side in SIDES}, args.blocks, WARMUP)
    med = report_sides(runs, args.blocks, args.steps)
    n, r = med["none"], med["replay"]
    print(f"produce replay/none: {r['produce'] / n['produce']:.3f}   "
          f"fit replay/none: {r['fit'] / n['fit']:.3f}")
    print(f"ratio: {r['step'] / n['step']:.3f}")


if __name__ == "__main__":
    main()
