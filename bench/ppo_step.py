"""PPO's step (recipe=ppo: a critic, GAE) over GRPO's (the default), on the default experiment, in one run.

    .venv/bin/python bench/ppo_step.py [--steps 12 --blocks 2] [overrides applied to both ...]

Each side is rlexp's own loop (`RLLoop`, vLLM, MLflow) in its own process, from the same
seed, model and data; only `recipe=ppo` differs. Blocks alternate GRPO/PPO so both meet the
same machine; the first 2 steps of each block are warm-up. Per side: the median step
(`timing/step_s` = produce + fit + sync), its fit and produce, the response length (the
two policies drift apart, and with them the tokens a step generates and trains), and the
driver process's peak resident memory (the policy, the reference, the critic and their
optimizers live there; vLLM's engine runs in its own processes).

The critic is the policy's network with a scalar head, so its cost is one forward for the
values before the update and one forward/backward per minibatch: about what the policy's
own forward/backward costs. Headline: median PPO step / median GRPO step."""

from __future__ import annotations

import json
import resource
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WARMUP = 2


def one_block(steps: int, overrides: list[str]) -> list[dict[str, float]]:
    from common import rlexp_step_times

    with tempfile.TemporaryDirectory() as tmp:
        records = rlexp_step_times(overrides, steps, Path(tmp))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return [r | {"peak_mb": peak_mb} for r in records]


def main() -> None:
    from common import two_sided_args

    args = two_sided_args(__doc__.split("\n")[0], ["grpo", "ppo"])
    if args.side:  # one block, in a child process: its per-step records as JSON into --out
        extra = ["recipe=ppo"] if args.side == "ppo" else []
        Path(args.out).write_text(json.dumps(one_block(args.steps + WARMUP, [*args.overrides, *extra])))
        return
    from common import alternate_blocks, report_sides

    me = [sys.executable, __file__, "--steps", str(args.steps), *args.overrides, "--side"]
    runs = alternate_blocks({"grpo": [*me, "grpo"], "ppo": [*me, "ppo"]}, args.blocks, WARMUP)
    med = report_sides(runs, args.blocks, args.steps)
    g, q = med["grpo"], med["ppo"]
    print(f"fit ppo/grpo: {q['fit'] / g['fit']:.3f}   "
          f"peak RSS ppo - grpo: {q['peak_mb'] - g['peak_mb']:.0f} MiB")
    print(f"ratio: {q['step'] / g['step']:.3f}")


if __name__ == "__main__":
    main()
