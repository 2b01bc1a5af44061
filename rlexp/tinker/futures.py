"""The Tinker API's futures: a call answers `{request_id}` at once and its result is fetched
by polling `retrieve_future`. Calls on one model run one at a time in the order of their
`seq_id` (the SDK numbers them; the chunks of one large call may arrive out of order), on
that model's own thread; a repeated (model, seq_id) with the same body is the same call (an
SDK retry), with another body two clients are driving one model: refused."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from rlexp.tinker.errors import BadRequest, not_found

KEEP_RESULTS = 10_000  # finished results kept for retrieve_future (oldest dropped first)
# A call numbered this far past the next to run cannot be one the SDK sent (it numbers its calls
# one by one; only the chunks of one large call arrive out of order): refused, not queued.
MAX_AHEAD = 4096


class Futures:
    """request id -> an asyncio future of its result (a JSON-able dict, protobuf bytes, or an
    exception: a BadRequest is the user's, anything else the server's)."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._results: OrderedDict[str, asyncio.Future] = OrderedDict()

    def new(self) -> tuple[str, asyncio.Future]:
        request_id = f"req-{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._results[request_id] = future
        while len(self._results) > KEEP_RESULTS:
            self._results.popitem(last=False)
        return request_id, future

    def get(self, request_id: str) -> asyncio.Future:
        if request_id not in self._results:
            raise not_found("request_id", request_id, "request_id")
        return self._results[request_id]


class Lane:
    """One model's calls, run in seq_id order on one thread."""

    def __init__(self, futures: Futures, name: str, next_seq: int = 1):
        self.futures, self.next_seq = futures, next_seq
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=f"rlexp-tinker-{name}")
        self._waiting: dict[int, tuple[Callable[[], Any], asyncio.Future] | None] = {}
        self._seen: dict[int, tuple[str, str]] = {}  # seq_id -> (body digest, request id)

    @contextmanager
    def numbered(self, seq_id: int | None) -> Iterator[None]:
        """Checks of a numbered request run inside: one refused there still takes its number
        (the SDK gave it one; the calls after it must not wait for it)."""
        try:
            yield
        except BadRequest:
            if seq_id is not None and self.next_seq <= seq_id < self.next_seq + MAX_AHEAD \
                    and seq_id not in self._waiting:
                self._waiting[seq_id] = None
                self._advance()
            raise

    def submit(self, seq_id: int | None, body: bytes, call: Callable[[], Any]) -> str:
        """A request id for `call`, run once every call numbered before it has run."""
        digest = hashlib.sha256(body).hexdigest()
        if seq_id is not None and seq_id in self._seen:
            seen_digest, request_id = self._seen[seq_id]
            if seen_digest != digest:
                raise BadRequest(f"seq_id {seq_id} was already used by another request to this model: "
                                 "two clients are driving one model (open a model per client)", "seq_id")
            return request_id
        if seq_id is not None and not self.next_seq <= seq_id < self.next_seq + MAX_AHEAD:
            raise BadRequest(f"seq_id {seq_id} is not among this model's next calls ({self.next_seq} .. "
                             f"{self.next_seq + MAX_AHEAD - 1})", "seq_id")
        request_id, future = self.futures.new()
        if seq_id is None:
            self._run(call, future)
            return request_id
        self._seen[seq_id] = (digest, request_id)
        self._waiting[seq_id] = (call, future)
        self._advance()
        return request_id

    def _advance(self) -> None:
        while self.next_seq in self._waiting:
            waiting = self._waiting.pop(self.next_seq)
            if waiting is not None:  # None: a refused request's number
                self._run(*waiting)
            self.next_seq += 1

    def _run(self, call: Callable[[], Any], future: asyncio.Future) -> None:
        loop = asyncio.get_running_loop()
        done = asyncio.wrap_future(self._thread.submit(call), loop=loop)
        done.add_done_callback(lambda d: settle(future, d))

    async def run_now(self, call: Callable[[], Any]) -> Any:
        """`call` on this model's thread after everything queued (not a numbered call)."""
        return await asyncio.wrap_future(self._thread.submit(call))

    def close(self, why: str = "the server is stopping") -> None:
        """No more calls: those waiting for an earlier number fail (410, `why`)."""
        self._thread.shutdown(wait=False, cancel_futures=True)
        for waiting in self._waiting.values():
            if waiting is not None and not waiting[1].done():
                waiting[1].set_exception(BadRequest(f"not run: {why}", "seq_id", 410))
        self._waiting.clear()


def settle(future: asyncio.Future, done: asyncio.Future) -> None:
    if future.done():
        return
    if done.cancelled():
        future.set_exception(RuntimeError("cancelled: the server is stopping"))
    elif (error := done.exception()) is not None:
        future.set_exception(error)
    else:
        future.set_result(done.result())


def failure(error: BaseException) -> dict[str, str]:
    """A failed call's result as the SDK reads it (RequestFailedError)."""
    category = "user" if isinstance(error, BadRequest) else "server"
    return {"error": f"{type(error).__name__}: {error}", "category": category}
