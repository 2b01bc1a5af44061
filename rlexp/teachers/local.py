"""`teacher=local`: the teacher model in a vLLM engine of its own, beside the student's, which
scores a sequence as one prefill returning its prompt logprobs (rlexp/rollout/vllm_engine.py
`VLLMEngine.score`). Concurrent requests are batched by the engine's scheduler like any other."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

from annotated_types import Ge, Le

from rlexp.constraints import AtLeast1, AtLeast2, Dtype, Positive
from rlexp.errors import ConfigError, TeacherError
from rlexp.rollout.vllm_engine import VLLMEngine
from rlexp.sample import PromptLogprobs

TopK = Annotated[int, Ge(0), Le(20)]  # vLLM returns at most max_logprobs (20) per position


class LocalTeacher:
    """`model_path`: the teacher's model directory (transformers layout, e.g. a run's policy
    exported by scripts/export_policy.py); `top_k`: alternatives per position returned besides
    the token's own logprob; `timeout_s`: the longest a sequence's scoring may take; `align`:
    its tokenizer differs from the student's, its scores are mapped through the text."""

    def __init__(self, model_path: str, seed: int = 0, top_k: TopK = 0, dtype: Dtype = "float32",
                 max_model_len: AtLeast2 = 256, kv_cache_gb: Positive = 1.0, max_num_seqs: AtLeast1 = 256,
                 timeout_s: Positive = 60.0, align: bool = False):
        if not (Path(model_path) / "config.json").is_file():
            raise ConfigError(f"teacher.model_path={model_path}: no model directory (config.json) there")
        self.top_k, self.timeout_s, self.tokenizer_path, self.align = top_k, timeout_s, model_path, align
        engine_len = _engine_len(model_path, max_model_len)
        self.engine = VLLMEngine(model_path, seed, dtype=dtype, max_model_len=engine_len,
                                 kv_cache_gb=kv_cache_gb, max_num_seqs=max_num_seqs, group_requests=False)

    async def score(self, token_ids: list[int]) -> PromptLogprobs:
        try:
            return await asyncio.wait_for(self.engine.score(token_ids, self.top_k), self.timeout_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            raise TeacherError(f"teacher=local did not score {len(token_ids)} tokens in "
                               f"{self.timeout_s:g} s (teacher.timeout_s)") from None

    def shutdown(self) -> None:
        self.engine.shutdown()


def _engine_len(model_path: str, max_model_len: int) -> int:
    """vLLM scores a prompt only with room for one generated token: a sample of
    `max_model_len` tokens needs an engine of one more, where the model's positions allow."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    text = config.get("text_config") or config
    positions = config.get("max_position_embeddings") or text.get("max_position_embeddings")
    return max_model_len + 1 if positions is None or positions > max_model_len else max_model_len
