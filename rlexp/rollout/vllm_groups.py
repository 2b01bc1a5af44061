"""A prompt group's requests, sent to vLLM as one request with `n > 1`.

The samples of a prompt group ask for the same prompt with the same sampling at the same
moment, with consecutive seeds (rlexp.agents.single_turn.request_seed). vLLM runs a request
with `n` and seed `s` as `n` requests seeded `s, s + 1, ..., s + n - 1`
(vllm/v1/engine/parallel_sampling.py), so one such request gives every sample the tokens its
own request would have given it (tests/test_engines.py checks it token for token), while the
engine's front end processes one request, not `n`. Requests that arrive within one turn of
the event loop are collected; those with the same prompt, sampling and token meter whose
seeds run consecutively go out together. Each caller still awaits its own reply: one that
is cancelled leaves the others running, and the request is aborted once all are cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import fields, replace
from functools import partial
from typing import Any

from rlexp.rollout.accounting import generated_tokens
from rlexp.sample import SamplingConfig

# One sample's reply: token ids, their logprobs, top alternatives, finish reason, the policy
# version that produced each token, and the version the request was sent at (its cache salt:
# the oldest weights whose KV its tokens may attend to).
Reply = tuple[list[int], list[float], list[dict[int, float]], str, list[int], int]
Send = Callable[[list[int], SamplingConfig, int], Awaitable[list[Reply]]]


class RequestGroups:
    """`request` as `send(token_ids, sampling, 1)[0]` would answer it; `send(..., n)` answers
    for the seeds `sampling.seed`, ..., `sampling.seed + n - 1`, in that order."""

    def __init__(self, send: Send):
        self._send = send
        self._waiting: dict[tuple, list[tuple[int, asyncio.Future[Reply]]]] = {}

    async def request(self, token_ids: list[int], sampling: SamplingConfig) -> Reply:
        assert sampling.seed is not None, "only seeded requests have a place in a group"
        # The meter is in the key: the request's task counts the tokens of all it answers
        # into the meter of the task that started it (rlexp/rollout/accounting.py).
        key = (tuple(token_ids), _settings(sampling), id(generated_tokens.get()))
        loop = asyncio.get_running_loop()
        waiting = self._waiting.setdefault(key, [])
        if not waiting:  # runs after the tasks already scheduled in this turn: the group's others
            loop.call_soon(self._flush, key, token_ids, sampling)
        future: asyncio.Future[Reply] = loop.create_future()
        waiting.append((sampling.seed, future))
        return await future

    def _flush(self, key: tuple, token_ids: list[int], sampling: SamplingConfig) -> None:
        for run in consecutive(sorted(self._waiting.pop(key), key=lambda w: w[0])):
            futures = [f for _, f in run]
            task = asyncio.ensure_future(self._send(token_ids, replace(sampling, seed=run[0][0]), len(run)))
            task.add_done_callback(partial(_deliver, futures))
            for f in futures:
                f.add_done_callback(partial(_abandon, task, futures))


_SETTINGS = [f.name for f in fields(SamplingConfig) if f.name != "seed"]


def _settings(sampling: SamplingConfig) -> tuple:
    """Every field of `sampling` but its seed, hashable (a dict as its sorted items)."""
    values = (getattr(sampling, name) for name in _SETTINGS)
    return tuple(tuple(sorted(v.items())) if isinstance(v, dict) else v for v in values)


def consecutive(waiting: list[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
    """`waiting`, sorted by seed, in runs of seeds that follow each other by one."""
    runs: list[list[tuple[int, Any]]] = []
    for w in waiting:
        if runs and w[0] == runs[-1][-1][0] + 1:
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs


def _deliver(futures: list[asyncio.Future[Reply]], task: asyncio.Future[list[Reply]]) -> None:
    for i, f in enumerate(futures):
        if f.done():
            continue  # its caller was cancelled
        if task.cancelled():
            f.cancel()
        elif task.exception() is not None:
            f.set_exception(task.exception())  # type: ignore[arg-type]
        else:
            f.set_result(task.result()[i])


def _abandon(task: asyncio.Future, futures: list[asyncio.Future[Reply]], _: asyncio.Future) -> None:
    if all(f.cancelled() for f in futures):
        task.cancel()  # nobody waits for it: abort it in the engine
