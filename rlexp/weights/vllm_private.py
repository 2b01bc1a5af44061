"""Every place where rlexp reaches past vLLM's public API, because vLLM has none for what is
needed. Each is checked against the vLLM in `CHECKED_WITH`; tests/test_vllm_private.py fails
when an upgrade moves one (`PLACES`: module, attribute, what rlexp relies on).

- The worker's idle spin: after its last message a vLLM worker busy-polls its input queue
  (`sched_yield`) for a hard-coded second before it sleeps on a socket; on a CPU machine that
  second is taken from the trainer's fit, which starts right after rollout. No setting or
  environment variable sets it; the worker does not hold the queue it reads (its process
  object does), so the readers are found among live objects.
- The rotary cache names: vLLM's layer-wise in-place reload (what every weight sync runs)
  counts every tensor of a module as a weight to load; the rotary embedding's cos/sin tables
  are computed from the config and are in no checkpoint, so at each sync it logged
  "RotaryEmbedding: Failed to load weights" (any model with rope) and put the unchanged table
  back. vLLM keeps its own never-loaded names in module-level sets; these are added to them.
- The CPU experts' repacking after a weight update: an MoE layer's unquantized method prepacks
  its experts for the CPU kernel (`moe_kernel.fused_experts.process_weights_after_loading`)
  at load, but on a reload it copies the new weights into the packed storage and skips the
  repack, so the engine computes with scrambled experts (logprobs off by ~0.2-1 after one
  sync). rlexp repacks each CPU MoE layer after its reload."""

from __future__ import annotations

import gc

CHECKED_WITH = "0.32.0"

PLACES = [
    ("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition",
     "readers (`is_reader`) busy-poll for `busy_loop_s` seconds after their last read"),
    ("vllm.model_executor.model_loader.reload.meta", "SKIP_LOAD_TENSORS",
     "a set of tensor names the layer-wise reload never loads"),
    ("vllm.model_executor.model_loader.reload.meta", "SKIP_TENSORS",
     "a set of tensor names the layer-wise reload never moves to the meta device"),
    ("vllm.model_executor.layers.rotary_embedding.base", "RotaryEmbedding",
     "its derived tables are the buffers named in DERIVED_BUFFERS"),
    ("vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod",
     "a reload skips `moe_kernel.fused_experts.process_weights_after_loading(layer)`, the CPU repack"),
    # routing capture on the CPU (rlexp/rollout/vllm_routing.py)
    ("vllm.model_executor.layers.fused_moe.router.base_router", "BaseRouter",
     "`set_capture_fn(fn)`: fn gets each forward's logical top-k expert ids [rows, k]"),
    ("vllm.model_executor.layers.fused_moe.layer", "MoERunner",
     "each MoE layer's, with `router` and `layer_id`"),
    ("vllm.v1.worker.gpu_input_batch", "InputBatch",
     "`req_ids` in a forward's row order, `num_computed_tokens_cpu` as before the step"),
]

# The rotary embeddings' cos/sin tables (buffers vLLM computes from the config).
DERIVED_BUFFERS = ("cos_sin_cache", "cos_sin_cache_bf16")


def skip_derived_buffers() -> bool:
    """Add DERIVED_BUFFERS to vLLM's sets of tensors its reload never loads (and never moves
    to the meta device); False if this vLLM has no such sets."""
    try:
        from vllm.model_executor.model_loader.reload import meta
    except ImportError:
        return False
    for name in ("SKIP_LOAD_TENSORS", "SKIP_TENSORS"):
        names = getattr(meta, name, None)
        if not isinstance(names, set):
            return False
        names.update(DERIVED_BUFFERS)
    return True


def set_idle_spin(seconds: float) -> int:
    """Set the busy-poll time of every reader of vLLM's shared-memory queues in this process;
    returns how many it set (0 if vLLM renamed them)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return 0
    # type(), not isinstance(): isinstance dereferences weak proxies, which may be dead
    readers = [o for o in gc.get_objects() if issubclass(type(o), SpinCondition) and o.is_reader]
    for r in readers:
        r.busy_loop_s = seconds
    return len(readers)


def repack_moe_experts(model) -> int:
    """Redo the CPU experts' prepacking of every MoE layer of `model` (vLLM's, in its worker)
    after a weight reload; returns how many layers it repacked (0: a dense model, or not on CPU)."""
    repacked = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        weight = getattr(module, "w13_weight", None)
        if experts is not None and weight is not None and weight.device.type == "cpu":
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
