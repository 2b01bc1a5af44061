"""A Tinker session's end (rlexp/tinker/service.py): closed by its client (ServiceClient.close)
or expired (its client gone: no heartbeat or call for tinker.session_timeout_s), its models are
released once the calls they queued have run, their MLflow runs ended, their places taken by
new models. The real SDK closing a session is tests/test_tinker_faults.py's."""

from __future__ import annotations

import asyncio

import pytest

from rlexp.tinker.errors import BadRequest
from rlexp.tinker.futures import Futures
from rlexp.tinker.models import Models
from rlexp.tinker.service import Service
from rlexp.tinker.store import Store

BASE = "rlexp/tiny-chat"
TIMEOUT_S = 300


class Run:
    """A model's MLflow run, as far as its end goes."""

    def __init__(self) -> None:
        self.status: str | None = None

    def end(self, status: str = "FINISHED") -> None:
        self.status = status


def _service(tmp_path, runs: dict[str, Run]) -> Service:
    def build(model_id, meta, seed):
        runs[model_id] = Run()
        return None, runs[model_id]

    models = Models(BASE, Store(tmp_path), Futures(), build, vocab_size=10, max_tokens=8, max_models=1)
    return Service(BASE, models, None, models.store, 10, 16, poll_s=1, tokenizer_dir="",  # type: ignore[arg-type]
                   session_timeout_s=TIMEOUT_S)


async def _model(service: Service, seq: int = 0) -> tuple[str, str]:
    session_id = service.create_session({})["session_id"]
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": BASE}
    created = service.create_model(body, repr(body).encode())
    await service.futures.get(created["request_id"])
    return session_id, created["model_id"]


def _refusal(call) -> tuple[int, str | None, str]:
    with pytest.raises(BadRequest) as e:
        call()
    return e.value.status, e.value.field, str(e.value)


def test_a_gone_clients_session_expires_and_its_model_makes_room(tmp_path):
    runs: dict[str, Run] = {}

    async def scenario() -> dict:
        service = _service(tmp_path, runs)
        gone, model = await _model(service)
        idle = service.create_session({})["session_id"]
        body = {"session_id": idle, "model_seq_id": 0, "base_model": BASE}
        full = _refusal(lambda: service.create_model(body, b"x"))
        last = service.models.models[model].last_call
        kept = await service.expire(now=last + TIMEOUT_S - 1)  # within the timeout: kept
        expired = await service.expire(now=last + TIMEOUT_S + 1)
        _, other = await _model(service)  # its place, taken
        return {"full": full, "kept": kept, "expired": expired, "gone": [gone, idle], "model": model,
                "other": other,                "call": _refusal(lambda: service.models.get(model)),
                "beat": _refusal(lambda: service.session(gone)), "left": sorted(service.models.models)}

    out = asyncio.run(scenario())
    assert out["full"][:2] == (400, "tinker.max_models")
    assert out["kept"] == [] and out["expired"] == out["gone"]
    assert out["left"] == [out["other"]] and runs[out["model"]].status == "KILLED"
    assert out["call"][:2] == (410, "model_id")
    assert "expired: no heartbeat or call for 300 s" in out["call"][2]
    assert out["beat"][0] == 410  # the SDK's heartbeat stops on a 410


def test_a_closed_session_runs_its_models_queued_calls_first_and_ends_their_runs_as_told(tmp_path):
    runs: dict[str, Run] = {}

    async def scenario() -> dict:
        service = _service(tmp_path, runs)
        session_id, model = await _model(service)
        lane = service.models.models[model].lane
        ran = lane.submit(1, b"step", lambda: "stepped")  # queued before the close: it runs
        stranded = lane.submit(3, b"later", lambda: "never")  # waits for a 2 that never comes
        bad = await asyncio.gather(service.finish(session_id, {"reason": {"type": "done"}}),
                                   return_exceptions=True)
        await service.finish(session_id, {"reason": {"type": "errored"}, "detail": "a crash"})
        results = [service.futures.get(r) for r in (ran, stranded)]
        await asyncio.gather(*results, return_exceptions=True)
        return {"bad": bad[0], "ran": results[0].result(), "stranded": results[1].exception(),
                "again": await asyncio.gather(service.finish(session_id, {}), return_exceptions=True),
                "model": model, "left": dict(service.models.models)}

    out = asyncio.run(scenario())
    assert isinstance(out["bad"], BadRequest) and out["bad"].field == "reason.type"
    assert out["ran"] == "stepped" and runs[out["model"]].status == "FAILED" and out["left"] == {}
    assert isinstance(out["stranded"], BadRequest) and out["stranded"].status == 410
    assert "was finished by its client (errored)" in str(out["stranded"])
    assert isinstance(out["again"][0], BadRequest) and out["again"][0].status == 410
