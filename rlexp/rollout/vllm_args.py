"""The arguments vLLM's engine is started with (`AsyncEngineArgs`), from VLLMEngine's settings:
those of every engine, then those that depend on the device and on the features asked for;
and the environment it starts in."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from rlexp.models.local import resolve_dtype


def engine_args(model_path: str, seed: int, dtype: str, max_model_len: int, max_num_seqs: int,
                enforce_eager: bool, max_num_batched_tokens: int, enable_sleep_mode: bool,
                on_gpu: bool) -> dict[str, Any]:
    """The engine arguments of every rlexp engine, on any device."""
    return dict(
        model=model_path,
        seed=seed,
        dtype=resolve_dtype(dtype),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        # RL ratios need logprobs of the distribution actually sampled from
        # (after temperature / top-p), not the raw model's.
        logprobs_mode="processed_logprobs",
        enforce_eager=enforce_eager,
        # Per-request seeds make rollouts reproducible; vLLM's CPU sampler crashes on
        # them when a prefill is chunked ("CPU Generator does not use offset").
        enable_chunked_prefill=False,
        max_num_batched_tokens=max(max_num_batched_tokens, max_model_len),
        enable_sleep_mode=enable_sleep_mode and on_gpu,
        worker_extension_cls="rlexp.rollout.vllm_worker.WorkerExtension",
        # JSON constraints (response_format) without free whitespace: a grammar that allows
        # it lets a model pad a reply with blank lines up to max_tokens (an engine setting)
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        # rlexp counts its own tokens and seconds; vLLM's per-engine-step statistics cost the
        # loop's thread ~6 ms a default step (docs/benchmarks.md, "Where the step's time goes")
        disable_log_stats=True,
    )


def device_args(on_gpu: bool, kv_cache_gb: float, gpu_memory_utilization: float, gpus_per_replica: int,
                weight_transfer_backend: str | None, routing_capture: bool) -> dict[str, Any]:
    """The engine arguments that depend on the device and on the features asked for."""
    out: dict[str, Any] = {}
    if routing_capture and on_gpu:
        out["enable_return_routed_experts"] = True
    elif routing_capture:  # a cached prompt block is not recomputed, so its routing is not seen
        out["enable_prefix_caching"] = False
    if weight_transfer_backend:  # vLLM's native weight transfer (e.g. ipc on GPU)
        out["weight_transfer_config"] = {"backend": weight_transfer_backend}
    if on_gpu:
        out |= {"gpu_memory_utilization": gpu_memory_utilization, "tensor_parallel_size": gpus_per_replica}
    else:
        out["kv_cache_memory_bytes"] = int(kv_cache_gb * (1 << 30))
        out |= IN_ENGINE_PROCESS
    return out


# On the CPU, vLLM's default runs its one worker in a process of its own beside the engine
# core's: a second spawned process that imports vLLM again (~17 s of each engine start on a
# 2-core machine) and busy-polls its queue. "uni" runs the worker in the engine core's process;
# vLLM keeps it only while VLLM_ENABLE_V1_MULTIPROCESSING=0 (CPU_ENV) is set at the start.
IN_ENGINE_PROCESS = {"distributed_executor_backend": "uni"}
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@contextlib.contextmanager
def environment(**values: str):
    """Environment variables set while vLLM starts (its processes inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
