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
  back. vLLM keeps its own never-loaded names in module-level sets; these are added to them."""

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
