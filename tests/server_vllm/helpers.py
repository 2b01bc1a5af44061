"""What the tests of the HTTP server on real vLLM share: the engine wrapper that records what
vLLM was given and generated, the server on one real engine in a background thread (served
to the tests by the package's `vllm_server` fixture, conftest.py), OpenAI clients and sessions
on it, the strict schemas tried, and small readers of sessions and samples."""

import asyncio
import contextlib
import dataclasses
import threading
from types import SimpleNamespace

from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer


class RecordingEngine:
    """Wraps a real engine; records exactly the tokens it was given and generated. `force`: a
    Constraint for the next generation in place of the request's, for a test to have vLLM
    write what a tiny model would not on its own (two tool calls)."""

    def __init__(self, engine):
        self.engine, self.calls, self.force = engine, [], None
        self.sampling, self.max_model_len = engine.sampling, engine.max_model_len

    @property
    def version(self):
        return self.engine.version

    async def generate(self, token_ids, sampling, images=None):
        return await self.generate_streaming(token_ids, sampling, None)

    async def generate_streaming(self, token_ids, sampling, on_tokens, images=None):
        if self.force is not None:
            sampling, self.force = dataclasses.replace(sampling, constraint=self.force), None
        gen = await self.engine.generate_streaming(token_ids, sampling, on_tokens)
        self.calls.append((list(token_ids), list(gen.token_ids)))
        return gen


@contextlib.contextmanager
def chat_server_on_vllm(model_path: str, tokenizer):
    """One real vLLM engine, recorded (RecordingEngine), behind the HTTP server, on an event loop
    in a background thread, so that tests can call it with blocking clients. Yields `run` (runs a
    coroutine there, blocking), the session store, the recorder and the server."""
    from rlexp.rollout.vllm_engine import VLLMEngine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro, timeout=300):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def start():
        engine = VLLMEngine(model_path, seed=0, max_model_len=512, kv_cache_gb=0.25, max_num_seqs=8)
        store = SessionStore(RecordingEngine(engine), tokenizer, max_context=512)
        server = ChatServer(store, max_body_bytes=1 << 20)
        await server.start()
        return engine, store, server

    engine, store, server = run(start())
    try:
        yield SimpleNamespace(run=run, store=store, recorder=store.engine, server=server)
    finally:
        run(server.stop())
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


# ---- for the random requests against the real server (test_random_requests.py) ----------
def _snapshot(store):
    return {sid: (s.calls, s.prefix_breaks, [(b.text, b.open, list(b.trace.tokens)) for b in s.branches])
            for sid, s in store.sessions.items()}


# ---- for the request fields through real vLLM (test_request_fields.py) -------------------
STRICT_SCHEMAS = {
    "required string and enum": {
        "type": "object", "additionalProperties": False, "required": ["expression", "mode"],
        "properties": {"expression": {"type": "string", "maxLength": 12},
                       "mode": {"enum": ["fast", "exact"]}}},
    "nested object": {
        "type": "object", "additionalProperties": False, "required": ["point"],
        "properties": {"point": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                                 "properties": {"x": {"type": "string", "maxLength": 4},
                                                "y": {"type": "boolean"}}}}},
    "array of enums, optional flag": {
        "type": "object", "additionalProperties": False, "required": ["ops"],
        "properties": {"ops": {"type": "array", "items": {"enum": ["+", "-", "*"]}, "minItems": 1,
                               "maxItems": 3},
                       "verbose": {"type": "boolean"}}},
}


def _client(vllm_server):
    import openai

    return openai.OpenAI(base_url=vllm_server.server.base_url, api_key="unused", max_retries=0)


def _session(vllm_server):
    return vllm_server.store.open()


def _stop_inside(text):
    """A stop string of two characters whose first occurrence in `text` is past its start."""
    return next(text[i:i + 2] for i in range(1, len(text) - 1) if text.index(text[i:i + 2]) == i)


def _trained_turns(sample):
    """(tokens, logprobs) of each span of a sample the policy wrote."""
    return [(sample.tokens[a:b], sample.logprobs[a:b]) for t in sample.turns if t["mask"]
            for a, b in [t["span"]]]
