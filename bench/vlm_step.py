"""A vision-language step against a text step of the same sizes, in one run: experiment=vlm
(the tiny SmolVLM-layout model counting shapes in 64-pixel pictures) over its text model alone
(the same Llama built by model=arch: 128 hidden, 2 layers, SmolLM2's tokenizer layout) on the
arithmetic task, same batch (16 prompts x 8 samples) and at most 2 response tokens on both
sides (the VLM's answers are a digit and the end of turn).

    .venv/bin/python bench/vlm_step.py [--steps 12 --blocks 2] [overrides applied to both ...]

Each side is rlexp's own loop (`RLLoop`, vLLM, MLflow) in its own process. Blocks alternate the
sides so both meet the same machine; the first 2 steps of each block are warm-up. What the
images add: the processor's rendering and pixel inputs in the agent, the vision tower and
connector in the engine and in every training forward, the vision weights in each sync, and
PNG files in the traces. Headline: median VLM step / median text step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
WARMUP = 2
BOTH = ["rollout.max_response_tokens=2", "data.prompts_per_step=16", "data.samples_per_prompt=8"]
SIDES = {"text": ["model=arch", "model.family=llama", "model.chat_template=smollm2",
                  "model.tie_word_embeddings=true", *BOTH],
         "vlm": ["experiment=vlm", *BOTH]}


def main() -> None:
    from common import two_sided_medians

    med = two_sided_medians(__doc__, __file__, SIDES, WARMUP)
    if med is None:  # a child block
        return
    t, v = med["text"], med["vlm"]
    print(f"produce vlm/text: {v['produce'] / t['produce']:.3f}   fit vlm/text: {v['fit'] / t['fit']:.3f}   "
          f"sync vlm/text: {v['sync'] / t['sync']:.3f}")
    print(f"ratio: {v['step'] / t['step']:.3f}")


if __name__ == "__main__":
    main()
