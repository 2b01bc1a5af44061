"""What a Tinker server refuses before a tenant costs anything (a 400 naming the field or the
server's key) and how a LoRA model's sampler weights reach the engine (rlexp/tinker/server.py
`served_adapter`). The tenants themselves, trained and sampled at once on one engine, are
tests/test_tinker_sdk.py's."""

from __future__ import annotations

import asyncio

import pytest

from rlexp.tinker.errors import BadRequest
from rlexp.tinker.futures import Futures
from rlexp.tinker.models import Models
from rlexp.tinker.server import served_adapter
from rlexp.tinker.store import Store
from rlexp.tinker.training import ServedAdapter

BASE = "rlexp/tiny-chat"


def _models(tmp_path, **kw) -> Models:
    unbuilt = lambda *args: (None, None)  # noqa: E731 - no trainer: the refusals come before it
    return Models(BASE, Store(tmp_path), Futures(), unbuilt, vocab_size=10, max_tokens=8, **kw)


def _lora(rank: int, unembed: bool) -> dict:
    return {"lora_config": {"rank": rank, "train_unembed": unembed}}


def test_a_rank_above_the_engines_is_refused_unless_the_model_is_sampled_merged(tmp_path):
    models = _models(tmp_path, adapter_rank=32)
    with pytest.raises(BadRequest, match=r"rank 64: .* up to rank 32 \(rollout.max_lora_rank\)") as e:
        models.meta(_lora(64, unembed=False), BASE)
    assert (e.value.field, e.value.status) == ("lora_config.rank", 400)
    assert models.meta(_lora(32, unembed=False), BASE)[0]["lora_rank"] == 32
    assert models.meta(_lora(64, unembed=True), BASE)[0]["lora_rank"] == 64  # a whole model: any rank
    assert _models(tmp_path, adapter_rank=0).meta(_lora(64, unembed=False), BASE)[0]["lora_rank"] == 64
    with pytest.raises(BadRequest, match="rank 64"):  # an engine that adapts the unembedding: an adapter too
        _models(tmp_path, adapter_rank=32, adapts_unembedding=True).meta(_lora(64, unembed=True), BASE)


def test_more_models_than_the_limit_are_refused_naming_the_key(tmp_path):
    async def create_three() -> list[str]:
        models, refused = _models(tmp_path, max_models=2), []
        for i in range(3):
            try:
                models.create(f"s:train:{i}", str(i).encode(), {"base_model": BASE}, None)
            except BadRequest as e:
                refused.append(f"{e.status} {e.field} {e}")
        models.create("s:train:1", b"1", {"base_model": BASE}, None)  # a repeat is the same call, not a third
        return refused

    (refused,) = asyncio.run(create_three())
    assert refused.startswith("400 tinker.max_models this server trains at most 2 models at once")


def test_an_adapter_reaches_the_engine_unless_it_trains_an_unembedding_the_engine_cannot_adapt():
    lora = {"alpha": 16, "target_modules": ["q_proj", "v_proj"]}
    parts = {"train_attn": True, "train_mlp": False}
    attn, unembed = parts | {"train_unembed": False}, parts | {"train_unembed": True}
    adapter = ServedAdapter(8, 16, ("q_proj", "v_proj"))
    assert served_adapter({"lora_rank": 8, "lora_parts": attn}, lora, 32, False) == adapter
    assert served_adapter({"lora_rank": 8, "lora_parts": unembed}, lora, 32, False) is None  # Qwen2
    assert served_adapter({"lora_rank": 8, "lora_parts": unembed}, lora, 32, True) == adapter  # Llama
    assert served_adapter({"lora_rank": 8, "lora_parts": attn}, lora, 0, True) is None
    assert served_adapter({"lora_rank": 0, "lora_parts": attn}, lora, 32, True) is None
