"""The model the Tinker server trains and samples: the configured model, with its output
embedding untied from its input embedding when the two are shared. Tinker's LoRA may train the
unembedding (`train_unembed`, on by default); with tied weights the engine could not serve that
(its lm_head *is* the input embedding), so the server works on a copy whose lm_head is its own
tensor, equal to the embedding at the start: the same model, numerically."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)
SOURCE_FILE = "rlexp_untied_from.json"


def served_copy(model_dir: Path, out: Path) -> Path:
    """`model_dir` itself if its embeddings are untied, else its untied copy in `out` (made once
    per source directory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    if not getattr(config, "tie_word_embeddings", False):
        return model_dir
    source = {"model_dir": str(model_dir.resolve())}
    if (out / SOURCE_FILE).exists() and json.loads((out / SOURCE_FILE).read_text()) == source:
        return out
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    weight = model.get_input_embeddings().weight.detach().clone()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(weight)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    (out / SOURCE_FILE).write_text(json.dumps(source))
    log.info("tinker: %s ties its embeddings; serving an untied copy at %s", model_dir, out)
    return out
