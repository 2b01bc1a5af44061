"""Routing capture inside vLLM's worker (CPU): the experts every MoE layer chose for every
token a request computed, for rollout routing replay.

vLLM's own capture (`enable_return_routed_experts`) needs its V2 model runner, which needs
Triton (GPU only). On the CPU, the same hook its capturer uses, each router's
`set_capture_fn` (called with the logical top-k expert ids of every row of a forward), is set
here; after each model step the rows are split per request by the batch's layout (requests in
the input batch's order, each with its scheduled tokens) and stored at their positions, so a
preempted and recomputed request overwrites rather than appends. Prompt tokens are captured
only when they are computed: prefix caching must be off (a cached block is not recomputed).

What a request gets (`take`, as bytes, shape and dtype; `unpack` makes the array): uint8
(uint16 beyond 256 experts) [positions, layers, k] for
positions 0 .. prompt + generated - 2, the tokens the engine forwarded (the last sampled token
never is). The places past vLLM's API used here are listed in rlexp/weights/vllm_private.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import numpy as np
import torch


class RoutingCapture:
    """One per worker: the current forward's rows per layer, and each request's routing so far."""

    def __init__(self, num_layers: int, num_experts: int):
        self.num_layers = num_layers
        self.dtype = np.uint8 if num_experts <= 256 else np.uint16
        self.rows: dict[int, torch.Tensor] = {}  # layer index -> [rows, k] of the forward being run
        self.requests: dict[str, np.ndarray] = {}  # vLLM's request id -> [positions, layers, k]

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        self.rows[layer] = topk_ids.detach().to("cpu", copy=True)

    def after_step(self, req_ids: list[str], scheduled: dict[str, int], computed: list[int]) -> None:
        """Split this step's rows: request i of `req_ids` owns the next `scheduled[id]` rows,
        at positions from `computed[i]` (its tokens computed before this step)."""
        if not self.rows or not scheduled:
            self.rows.clear()
            return
        step = torch.stack([self.rows[i] for i in sorted(self.rows)], dim=1).numpy().astype(self.dtype)
        self.rows.clear()
        offset = 0
        for rid, start in zip(req_ids, computed):
            n = scheduled.get(rid, 0)
            if not n:
                continue
            have = self.requests.get(rid)
            if have is None or len(have) < start + n:
                grown = np.zeros((start + n, *step.shape[1:]), self.dtype)
                if have is not None:
                    grown[:len(have)] = have
                have = self.requests[rid] = grown
            have[start:start + n] = step[offset:offset + n]
            offset += n

    def take(self, external_ids: list[str]) -> dict[str, tuple[bytes, tuple[int, ...], str]]:
        """Each finished request's routing (by the id the engine was given) as raw bytes, shape
        and dtype (what crosses vLLM's RPC compactly), dropped here."""
        wanted = set(external_ids)
        found = {rid: rid.rsplit("-", 1)[0] for rid in self.requests}  # vLLM appends "-<8 hex>"
        taken = {ext: self.requests.pop(rid) for rid, ext in found.items() if ext in wanted}
        return {ext: (a.tobytes(), a.shape, a.dtype.str) for ext, a in taken.items()}


def install(runner: Any) -> int:
    """Set the capture on every MoE router of the runner's model and split the rows after
    each `execute_model`; returns the number of MoE layers (0: a dense model, nothing set)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    if getattr(runner, "rlexp_routing", None) is not None:
        return runner.rlexp_routing.num_layers
    moe = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
    if not moe:
        return 0
    if not all(isinstance(m.router, BaseRouter) for m in moe):
        raise ValueError(f"routing capture: a router of another kind ({type(moe[0].router).__name__})")
    config = runner.model_config
    capture = RoutingCapture(len(moe), config.get_num_experts())
    for index, m in enumerate(sorted(moe, key=lambda m: m.layer_id)):
        m.router.set_capture_fn(partial(capture.capture, index))
    execute = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        capture.rows.clear()
        out = execute(scheduler_output, *args, **kwargs)
        batch = runner.input_batch
        ids = list(batch.req_ids)
        capture.after_step(ids, dict(scheduler_output.num_scheduled_tokens),
                           [int(batch.num_computed_tokens_cpu[i]) for i in range(len(ids))])
        return out

    runner.execute_model = execute_model
    runner.rlexp_routing = capture
    return len(moe)


def take(runner: Any, request_ids: list[str]) -> dict[str, tuple[bytes, tuple[int, ...], str]]:
    capture: RoutingCapture | None = getattr(runner, "rlexp_routing", None)
    return capture.take(request_ids) if capture is not None else {}


def unpack(taken: tuple[bytes, tuple[int, ...], str]) -> np.ndarray:
    data, shape, dtype = taken
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)


class RoutingFetcher:
    """The engine's side: each finished request's routing, fetched from the workers in one
    call for all the requests that finish together (`take(ids)`: the workers' answers to
    `take_routing`; a call per request cost a step of 256 samples ~0.1 s)."""

    WAIT_S = 0.002  # how long a fetch waits for other requests to finish with it

    def __init__(self, take: Callable[[list[str]], Awaitable[list[dict]]]):
        self.take = take
        self.wanted: dict[str, asyncio.Future] = {}  # request id -> its routing, to fetch
        self.fetching: asyncio.Future | None = None

    async def get(self, request_id: str) -> np.ndarray:
        wanted = asyncio.get_running_loop().create_future()
        self.wanted[request_id] = wanted
        if self.fetching is None:
            self.fetching = asyncio.ensure_future(self._fetch())
        return unpack(await wanted)

    async def _fetch(self) -> None:
        await asyncio.sleep(self.WAIT_S)  # the requests finishing in the same engine steps join
        wanted, self.wanted, self.fetching = self.wanted, {}, None
        try:
            (taken, *_) = await self.take(list(wanted))
        except BaseException as e:
            for future in wanted.values():
                if not future.done():
                    future.set_exception(e)  # each waiting request raises it (EngineDead, ...)
            return
        for rid, future in wanted.items():
            if not future.done():
                future.set_result(taken[rid])
