"""`teacher=openai`: a teacher behind any OpenAI-compatible server that returns prompt logprobs
(vLLM's OpenAI server, the reference: `serve_command` in serve.py), reached over HTTP; the
server batches the requests in flight (at most `max_concurrency` at once).

One sequence, one request, token-in (no text crosses, so no re-tokenization):

    POST {base_url}/completions
    {"model": model, "prompt": [id, ...], "max_tokens": 1, "temperature": 1.0,
     "prompt_logprobs": top_k, "echo": false}

vLLM replies (the generated token is ignored):

    {"choices": [{"prompt_logprobs": [null,
                                      {"<id>": {"logprob": -1.2, "rank": 3, "decoded_token": "x"},
                                       ...}, ...], ...}], ...}

one entry per prompt token; the first is null (nothing predicts it), entry i holds the actual
token i (whatever its rank) and the `top_k` likeliest ids (ranks 1 .. top_k; top_k=0: the
actual token alone). Keys are the ids as strings (JSON). `max_tokens` must be at least 1 (vLLM
refuses 0 without `echo`), so the longest sequence one request scores is the server's
`--max-model-len` less one token.

vLLM's prompt logprobs are the raw model distribution: log_softmax of the logits at
temperature 1, untouched by any sampling setting (its default `--logprobs-mode raw_logprobs`;
prompt tokens skip the sampling processors, so `processed_logprobs` gives the same). A server
started with `--logprobs-mode raw_logits` returns logits instead: positive ones are refused
here, negative ones cannot be told apart. vLLM writes a logprob of -inf as -9999.0.

Every reply is checked: a missing field, a list of the wrong length, a position without the
actual token, a logprob that is not a finite number <= 0 is a TeacherError naming what was
wrong, as are an HTTP error status, an unreachable server and a reply slower than `timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from typing import Any

import httpx

from rlexp.constraints import AtLeast0, AtLeast1, Positive
from rlexp.errors import ConfigError, TeacherError
from rlexp.sample import PromptLogprobs
from rlexp.teachers.serve import serve_command

CHECK_TIMEOUT_S = 5.0  # the preflight's wait for each reply (`/models`, served.py's) before any engine
CLOSE_TIMEOUT_S = 5.0


class Malformed(ValueError):
    """What is wrong with a reply (the caller names the url)."""


class OpenAITeacher:
    """`base_url`: the server's OpenAI root ("http://127.0.0.1:8000/v1"); `model`: the served
    model's name; `api_key`: sent as a bearer token; `top_k`: alternatives per position besides
    the token's own logprob; `timeout_s`: the longest one request may take once sent (waiting
    for a slot does not count); `max_concurrency`: requests in flight at once; `tokenizer`: the
    directory of the teacher's tokenizer (None: the student's); `align`: that tokenizer differs
    from the student's, its scores are mapped through the text; `same_tokenizer`: the server
    uses the student's tokenizer, for a server that cannot be asked which it uses (no
    `/tokenize`, served.py)."""

    def __init__(self, base_url: str, model: str, api_key: str | None = None, top_k: AtLeast0 = 0,
                 timeout_s: Positive = 60.0, max_concurrency: AtLeast1 = 32, tokenizer: str | None = None,
                 align: bool = False, same_tokenizer: bool = False):
        self.base_url, self.model, self.api_key = base_url.rstrip("/"), model, api_key
        self.top_k, self.timeout_s, self.max_concurrency = top_k, timeout_s, max_concurrency
        self.tokenizer_path, self.align, self.same_tokenizer = tokenizer, align, same_tokenizer
        self.url = f"{self.base_url}/completions"
        self._client: httpx.AsyncClient | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _client_here(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        """The client and the slots of the running loop: made on first use, as an httpx client's
        connections belong to the loop that opened them."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._semaphore is None or self._loop is not loop:
            self.shutdown()
            limits = httpx.Limits(max_connections=self.max_concurrency,
                                  max_keepalive_connections=self.max_concurrency)
            self._client = httpx.AsyncClient(headers=self._headers(), timeout=self.timeout_s,
                                             limits=limits, trust_env=False)
            self._semaphore, self._loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._client, self._semaphore

    async def score(self, token_ids: list[int]) -> PromptLogprobs:
        """log p(token_ids[i] | token_ids[:i]) for i = 1 .. n - 1, with the top_k ids per position."""
        if not token_ids:
            raise TeacherError("teacher=openai: no tokens to score")
        client, slots = self._client_here()
        request = {"model": self.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 1.0,
                   "prompt_logprobs": self.top_k, "echo": False}
        async with slots:
            try:
                reply = await asyncio.wait_for(client.post(self.url, json=request), self.timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                raise TeacherError(f"teacher=openai: {self.url} did not answer within {self.timeout_s:g} s "
                                   f"(teacher.timeout_s)") from None
            except httpx.HTTPError as e:
                raise TeacherError(f"teacher=openai: {self.url} is unreachable ({_reason(e)})") from None
        if reply.status_code != 200:
            raise TeacherError(f"teacher=openai: {self.url} answered HTTP {reply.status_code} to "
                               f"{len(token_ids)} tokens: {_one_line(reply.text)}")
        try:
            body = reply.json()
        except ValueError:
            raise TeacherError(f"teacher=openai: {self.url} replied with a body that is not JSON: "
                               f"{_one_line(reply.text)}") from None
        try:
            return parse_reply(body, token_ids, self.top_k)
        except Malformed as e:
            raise TeacherError(f"teacher=openai: {self.url} replied with {e}") from None

    def check(self, max_model_len: int | str = "<n>") -> None:
        """Preflight, before any engine starts: the server answers and serves `model`, else
        ConfigError (one line; `max_model_len`: what the command it suggests starts the server
        with). Its tokenizer is checked next (served.py)."""
        url = f"{self.base_url}/models"
        try:
            with httpx.Client(headers=self._headers(), timeout=CHECK_TIMEOUT_S, trust_env=False) as http:
                reply = http.get(url)
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            start = serve_command(name=self.model, port=_port(self.base_url), max_model_len=max_model_len)
            raise ConfigError(f"teacher=openai: {self.base_url} is unreachable ({_reason(e)}): start the "
                              f"teacher's server (e.g. `{start}`) or set teacher.base_url") from None
        if reply.status_code != 200:
            raise ConfigError(f"teacher=openai: {url} answered HTTP {reply.status_code}: "
                              f"{_one_line(reply.text)}")
        try:
            served = [m["id"] for m in reply.json()["data"]]
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"teacher=openai: {url} is not an OpenAI model list: "
                              f"{_one_line(reply.text)}") from None
        if self.model not in served:
            raise ConfigError(f"teacher.model={self.model} is not served by {self.base_url}; it serves "
                              f"{', '.join(map(str, served)) or 'none'}")

    def shutdown(self) -> None:
        """Close the client: from its loop's code, or from sync code while that loop lives (on
        this thread or another). After the loop was closed nothing can close its connections any
        more: they are dropped (their sockets close when collected)."""
        client, loop = self._client, self._loop
        self._client, self._semaphore, self._loop = None, None, None
        if client is None or client.is_closed or loop is None or loop.is_closed():
            return
        here = _running_loop()
        if here is loop:
            task = loop.create_task(client.aclose())
            _CLOSING.add(task)
            task.add_done_callback(_CLOSING.discard)
        elif loop.is_running():  # on another thread
            future = asyncio.run_coroutine_threadsafe(client.aclose(), loop)
            if here is None:  # never block a loop
                with contextlib.suppress(Exception):
                    future.result(CLOSE_TIMEOUT_S)
        elif here is None:
            with contextlib.suppress(Exception):
                loop.run_until_complete(client.aclose())


_CLOSING: set[asyncio.Task[None]] = set()  # closes in flight (a task unreferenced may be collected)


def parse_reply(reply: Any, token_ids: list[int], top_k: int) -> PromptLogprobs:
    """vLLM's completion reply -> the logprob of each token after the first, and the top_k
    likeliest ids per position (by rank); Malformed says what is wrong."""
    try:
        entries = reply["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise Malformed(f"no choices[0].prompt_logprobs: {_one_line(str(reply))}") from None
    if not isinstance(entries, list):
        raise Malformed(f"prompt_logprobs {_one_line(str(entries))}, not a list (does the server return "
                        f"prompt logprobs? vLLM does)")
    if len(entries) != len(token_ids):
        raise Malformed(f"{len(entries)} prompt_logprobs entries for {len(token_ids)} tokens "
                        f"({'truncated' if len(entries) < len(token_ids) else 'too many'})")
    logprobs, top = [], []
    for i, (token, entry) in enumerate(zip(token_ids[1:], entries[1:]), start=1):
        scores = _position(entry, i)
        if token not in scores:
            raise Malformed(f"no logprob of the actual token {token} at position {i}")
        logprobs.append(scores[token][0])
        if top_k:
            top.append(_top(scores, top_k, i))
    return PromptLogprobs(logprobs, top if top_k else None)


def _position(entry: Any, i: int) -> dict[int, tuple[float, int | None]]:
    """One position's entry -> {id: (logprob, rank)}, every logprob a finite number <= 0."""
    if not isinstance(entry, dict):
        raise Malformed(f"prompt_logprobs[{i}] is {_one_line(str(entry))}, not a dict of ids")
    out: dict[int, tuple[float, int | None]] = {}
    for key, value in entry.items():
        try:
            token, logprob = int(key), value["logprob"]
        except (ValueError, KeyError, TypeError):
            raise Malformed(f"prompt_logprobs[{i}] has {key!r}: {_one_line(str(value))}, not an id with "
                            f"a logprob") from None
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not math.isfinite(logprob):
            raise Malformed(f"a non-finite logprob {logprob!r} for token {token} at position {i}")
        if logprob > 0:
            raise Malformed(f"a positive logprob {logprob!r} for token {token} at position {i} (logits, "
                            f"not logprobs? start vLLM with its default --logprobs-mode raw_logprobs)")
        rank = value.get("rank")
        out[token] = (float(logprob), rank if isinstance(rank, int) and not isinstance(rank, bool) else None)
    return out


def _top(scores: dict[int, tuple[float, int | None]], top_k: int, i: int) -> dict[int, float]:
    """The ids of ranks 1 .. top_k at one position (the actual token is there only if among them)."""
    ranked = sorted((rank, -lp, token) for token, (lp, rank) in scores.items()
                    if rank is not None and rank <= top_k)
    if len(ranked) < top_k:
        raise Malformed(f"{len(ranked)} of the top_k={top_k} ranked ids at position {i}")
    return {token: -neg for _, neg, token in ranked[:top_k]}


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _port(url: str) -> str:
    try:
        return str(httpx.URL(url).port or "...")
    except httpx.InvalidURL:
        return "..."


def _reason(e: BaseException) -> str:
    return _one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)


def _one_line(text: str, limit: int = 300) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."
