"""The Tinker API over HTTP (FastAPI): the routes the `tinker` SDK 0.38 calls, under
/api/v1/, mapped onto the Service. Bodies are JSON except forward_backward's (protobuf); the
results of forward/backward and sampling go back as protobuf, the SDK's format for them.

Every request the server cannot serve gets a 4xx naming the field (`{"detail": ..., "field":
...}`), and a call that fails after it was accepted fails its future with the reason (the
SDK raises RequestFailedError), never a 5xx. A pending future answers 408 after `poll_s`
(the SDK polls again at once)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlexp.tinker.errors import BadRequest
from rlexp.tinker.service import Service
from rlexp.tinker.wire import parse_json

log = logging.getLogger(__name__)
PROTOBUF = "application/x-protobuf"


def error(status: int, message: str, field: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": message, "field": field})


Body = Callable[[Request], Awaitable[tuple[dict[str, Any], bytes]]]
V1 = "/api/v1"


def create_app(service: Service, api_key: str | None, max_body_bytes: int) -> FastAPI:
    app = FastAPI(title="rlexp Tinker API")
    guard(app, api_key, max_body_bytes)

    async def body(request: Request) -> tuple[dict[str, Any], bytes]:
        raw = await request.body()
        if len(raw) > max_body_bytes:  # a chunked body declares no length
            raise BadRequest(f"the request body is over the limit of {max_body_bytes} bytes", None, 413)
        return parse_json(raw), raw

    add_client_routes(app, service, body)
    add_training_routes(app, service, body)
    add_sampling_routes(app, service, body)
    add_rest_routes(app, service)
    return app


def guard(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    """The API key, the body's size and encoding; every refusal as a 4xx naming its field."""
    @app.middleware("http")
    async def check(request: Request, call_next):
        if api_key and not secrets.compare_digest(request.headers.get("x-api-key", ""), api_key):
            return error(401, "missing or wrong API key (X-API-Key)")
        declared = request.headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > max_body_bytes:
            return error(413, f"the request body is over the limit of {max_body_bytes} bytes")
        if request.headers.get("content-encoding", "identity") != "identity":
            return error(415, f"Content-Encoding {request.headers['content-encoding']!r} is not served "
                              "(the server's client config leaves compression off)", "content-encoding")
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return error(exc.status, str(exc), exc.field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown path, wrong method
        return error(exc.status_code, str(exc.detail))


def add_client_routes(app: FastAPI, service: Service, body: Body) -> None:
    """What a ServiceClient asks first: its config, the server's models, its session."""
    @app.post(f"{V1}/client/config")
    async def client_config():
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False,
                "sample_use_retrieve_futures": False}

    @app.post(f"{V1}/client/dynamic_config")
    async def dynamic_config():
        return {}

    @app.get(f"{V1}/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get(f"{V1}/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": service.base_model,
                                      "max_context_length": service.max_model_len,
                                      "trainable": True, "sampleable": True}]}

    @app.post(f"{V1}/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    @app.post(f"{V1}/create_session")
    async def create_session(request: Request):
        return service.create_session((await body(request))[0])

    @app.post(f"{V1}/session_heartbeat")
    async def heartbeat(request: Request):
        service.session((await body(request))[0].get("session_id"))
        return {"type": "session_heartbeat"}

    @app.post(V1 + "/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        await service.finish(session_id, (await body(request))[0])
        return Response(status_code=204)

    @app.get(V1 + "/sessions/{session_id}")
    async def get_session(session_id: str):
        service.session(session_id, "session_id")
        prefix = f"{session_id}:"
        return {"training_run_ids": [m for m in service.models.models if m.startswith(prefix)],
                "sampler_ids": [s for s in service.samplers if s.startswith(prefix)]}


def add_training_routes(app: FastAPI, service: Service, body: Body) -> None:
    """A TrainingClient's calls: its model, forward(_backward), optim_step, checkpoints."""
    @app.post(f"{V1}/create_model")
    async def create_model(request: Request):
        return service.create_model(*await body(request))

    @app.post(f"{V1}/load_weights")
    async def load_weights(request: Request):
        return service.load_weights(*await body(request))

    @app.post(f"{V1}/get_info")
    async def get_info(request: Request):
        return service.get_info((await body(request))[0])

    @app.post(f"{V1}/forward_backward")
    async def forward_backward(request: Request):
        raw = await request.body()
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise BadRequest(f"forward_backward takes a protobuf body (Content-Type: {PROTOBUF})",
                             "content-type", 415)
        request_id, model_id = service.models.forward_backward(raw)
        return {"request_id": request_id, "model_id": model_id}

    @app.post(f"{V1}/optim_step")
    async def optim_step(request: Request):
        body_, raw = await body(request)
        return {"request_id": service.models.optim_step(body_, raw), "model_id": body_["model_id"]}

    @app.post(f"{V1}/save_weights")
    async def save_weights(request: Request):
        body_, raw = await body(request)
        return {"request_id": service.models.save_state(body_, raw), "model_id": body_["model_id"]}

    @app.post(f"{V1}/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        body_, raw = await body(request)
        return {"request_id": service.models.save_for_sampler(body_, raw, service.register_sampler),
                "model_id": body_["model_id"]}


def add_sampling_routes(app: FastAPI, service: Service, body: Body) -> None:
    """A SamplingClient's calls, and every call's result (futures)."""
    @app.post(f"{V1}/create_sampling_session")
    async def create_sampling_session(request: Request):
        return service.create_sampling_session((await body(request))[0])

    @app.get(V1 + "/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        return service.get_sampler(sampler_id)

    @app.post(f"{V1}/asample")
    async def asample(request: Request):
        return service.sample((await body(request))[0])

    @app.post(f"{V1}/retrieve_future")
    async def retrieve_future(request: Request):
        asked = (await body(request))[0]
        kind, result = await service.retrieve(asked)
        if kind == "pending":
            return JSONResponse(status_code=408, content={"type": "try_again", "queue_state": "active",
                                                          "request_id": asked["request_id"]})
        if kind == "bytes":
            return Response(result, media_type=PROTOBUF)
        return result


def add_rest_routes(app: FastAPI, service: Service) -> None:
    """The RestClient's routes the cookbook uses: training runs, their checkpoints."""
    v1, store = V1, service.store

    @app.get(f"{v1}/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0):
        runs = store.runs()
        return {"training_runs": [store.training_run(r) for r in runs[offset:offset + limit]],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    @app.get(v1 + "/training_runs/{model_id}")
    async def training_run(model_id: str):
        return store.training_run(model_id)

    @app.get(v1 + "/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str):
        return {"checkpoints": store.meta(model_id)["checkpoints"]}

    @app.delete(v1 + "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str):
        kind, _, name = checkpoint_id.partition("/")
        if kind not in ("weights", "sampler_weights") or not name or "/" in name:
            raise BadRequest(f"checkpoint id {checkpoint_id!r} is not (weights|sampler_weights)/<name>",
                             "checkpoint_id")
        store.delete(model_id, kind, name)
        return Response(status_code=204)

    @app.post(f"{v1}/weights_info")
    async def weights_info(request: Request):
        from rlexp.tinker.wire import get, tinker_path

        model_id, _, _ = tinker_path(get(parse_json(await request.body()), "tinker_path", str), "tinker_path")
        meta = store.meta(model_id)
        parts = meta["lora_parts"]
        return {"base_model": meta["base_model"], "is_lora": meta["lora_rank"] > 0,
                "lora_rank": meta["lora_rank"] or None, **parts}
