"""An OpenAI-compatible HTTP server over a SessionStore, so agent code written against the
real `openai` package produces the same token-level traces as the in-process client.

    server = ChatServer(store)           # loopback, a free port
    await server.start(); server.base_url -> "http://127.0.0.1:PORT/v1"
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused")
    await client.chat.completions.create(model="policy", messages=[...],
                                         extra_body={"session_id": sid})

Sessions are named by `session_id` in the JSON body or an `X-Session-Id` header;
`POST /v1/sessions` opens one. Bad requests get an OpenAI-style error body with a 4xx
status. Binding to anything but loopback requires `api_key` (checked as a Bearer token)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlexp.agents.single_turn import encode
from rlexp.errors import SessionError

log = logging.getLogger(__name__)


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param,
                                           "code": None}})


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(store, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="rlexp policy server")

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given, f"Bearer {api_key}"):
                return _error(401, "missing or wrong API key", "authentication_error")
        return await call_next(request)

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError:
            raise SessionError("the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise SessionError("the request body must be a JSON object")
        return body

    def session_of(request: Request, body: dict[str, Any]) -> str:
        sid = body.pop("session_id", None) or request.headers.get("x-session-id")
        if not sid:
            raise SessionError("no session_id: put it in the body (extra_body) or an X-Session-Id header")
        return str(sid)

    @app.exception_handler(SessionError)
    async def session_error(request: Request, exc: SessionError):
        status = 404 if "unknown session" in str(exc) else 400
        return _error(status, str(exc))

    @app.get("/health")
    async def health():
        return {"status": "ok", "policy_version": store.engine.version}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": store.model_name, "object": "model", "owned_by": "rlexp"}]}

    @app.post("/v1/sessions")
    async def open_session():
        return {"session_id": store.open()}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await body_of(request)
        if body.get("stream"):
            raise SessionError("stream=true is not supported")
        # A ready JSONResponse skips FastAPI's per-field encoder (slow on token-level logprobs).
        return JSONResponse(await store.chat(session_of(request, body), body))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return JSONResponse(await store.complete(await body_of(request)))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await body_of(request)
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise SessionError("'messages' must be a non-empty list")
            text = store.tokenizer.apply_chat_template(
                messages, add_generation_prompt=bool(body.get("add_generation_prompt", True)), tokenize=False)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise SessionError("give 'messages' or 'prompt'")
        tokens = encode(store.tokenizer, text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": store.max_context}

    return app


class ChatServer:
    """uvicorn serving `create_app(store)` as a task on the current event loop."""

    def __init__(self, store, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None):
        if not _is_loopback(host) and not api_key:
            raise ValueError(f"refusing to serve the policy on {host} without an api_key "
                             "(only loopback addresses may go without one)")
        self.store, self.host, self.api_key = store, host, api_key
        config = uvicorn.Config(create_app(store, api_key), host=host, port=port, log_level="warning",
                                lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task | None = None
        self.port = port

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the startup error
                raise RuntimeError("the policy server stopped during start-up")
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        log.info("policy server on %s", self.base_url)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    async def stop(self) -> None:
        if self._task is not None:
            self._server.should_exit = True
            await self._task
            self._task = None
