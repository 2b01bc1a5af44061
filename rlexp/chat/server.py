"""An OpenAI-compatible HTTP server over a SessionStore, so agent code written against the
real `openai` package produces the same token-level traces as the in-process client.

    server = ChatServer(store)           # loopback, a free port
    await server.start(); server.base_url -> "http://127.0.0.1:PORT/v1"
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused")
    await client.chat.completions.create(model="policy", messages=[...],
                                         extra_body={"session_id": sid})

Sessions are named by `session_id` in the JSON body or an `X-Session-Id` header;
`POST /v1/sessions` opens one. Every bad request (rlexp/chat/schema.py) gets a 4xx with an
OpenAI-style error body naming the field; a body over `max_body_bytes` gets 413. Binding
to anything but loopback requires `api_key` (checked as a Bearer token)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rlexp.chat.render import encode, render_chat
from rlexp.chat.schema import ChatRequest, CompletionRequest, TokenizeRequest, parse
from rlexp.errors import EngineDead, SessionError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           code: str | None = None):
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _guard(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    """The API key and body-size checks, and every error as an OpenAI-shaped JSON answer."""
    @app.middleware("http")
    async def check_key_and_size(request: Request, call_next):
        if api_key and request.url.path != "/health":
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given, f"Bearer {api_key}"):
                return _error(401, "missing or wrong API key", "authentication_error")
        declared = request.headers.get("content-length", "0")
        if not declared.isdigit() or int(declared) > max_body_bytes:
            return _error(413, f"the request body is over the limit of {max_body_bytes} bytes")
        return await call_next(request)

    @app.exception_handler(SessionError)
    async def session_error(request: Request, exc: SessionError):
        return _error(exc.status, str(exc), param=exc.param, code=exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown path, wrong method
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(EngineDead)
    async def engine_dead(request: Request, exc: EngineDead):
        return _error(503, str(exc), "server_error")


async def _event_stream(reply: Callable[[Callable[[dict], None]], Awaitable[Any]]) -> StreamingResponse:
    """`reply(emit)` as server-sent events: `data: <chunk>` per chunk, then `data: [DONE]`.
    An error before the first chunk is an ordinary error answer (4xx); after it, an `error`
    event ends the stream. A client that disconnects cancels the reply: its session records
    nothing of it."""
    queue: asyncio.Queue[dict | None] = asyncio.Queue()
    task = asyncio.ensure_future(reply(queue.put_nowait))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    first = await queue.get()
    if first is None:  # ended before any chunk: raises its error, if it had one
        task.result()

    async def events():
        item = first
        try:
            while item is not None:
                yield f"data: {json.dumps(item)}\n\n"
                item = await queue.get()
            error = task.exception()
            if isinstance(error, (SessionError, EngineDead)):
                body = {"error": {"message": str(error), "type": "invalid_request_error" if isinstance(
                    error, SessionError) else "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(body)}\n\n"
            elif error is not None:
                raise error
            yield "data: [DONE]\n\n"
        finally:
            task.cancel()  # the client went away: stop generating

    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(store, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    app = FastAPI(title="rlexp policy server")
    _guard(app, api_key, max_body_bytes)

    async def body_of(request: Request) -> Any:
        raw = await request.body()
        if len(raw) > max_body_bytes:  # a chunked body declares no length
            raise SessionError(f"the request body is over the limit of {max_body_bytes} bytes", status=413)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            raise SessionError("the request body is not valid JSON") from None

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
        body = parse(ChatRequest, await body_of(request), store.model_name)
        sid = body.session_id or request.headers.get("x-session-id")
        if not sid:
            raise SessionError("no session_id: put it in the body (extra_body) or an X-Session-Id header",
                               param="session_id")
        if body.stream:
            return await _event_stream(lambda emit: store.chat(sid, body, emit=emit))
        # A ready JSONResponse skips FastAPI's per-field encoder (slow on token-level logprobs).
        return JSONResponse(await store.chat(sid, body))

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse(CompletionRequest, await body_of(request), store.model_name)
        if body.stream:
            return await _event_stream(lambda emit: store.complete(body, emit=emit))
        return JSONResponse(await store.complete(body))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = parse(TokenizeRequest, await body_of(request))
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        text = body.prompt or render_chat(store.tokenizer, [m.for_template() for m in body.messages or []],
                                          tools, body.add_generation_prompt, store.tool_prompt)
        tokens = encode(store.tokenizer, text)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": store.max_context}

    return app


class ChatServer:
    """uvicorn serving `create_app(store)` as a task on the current event loop."""

    def __init__(self, store, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        if not _is_loopback(host) and not api_key:
            raise ValueError(f"refusing to serve the policy on {host} without an api_key "
                             "(only loopback addresses may go without one)")
        self.store, self.host, self.api_key = store, host, api_key
        config = uvicorn.Config(create_app(store, api_key, max_body_bytes), host=host, port=port,
                                log_level="warning",
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
