"""Runs inside vLLM's worker processes (vLLM's `worker_extension_cls`): the methods here
are added to each worker and called with `AsyncLLM.collective_rpc`."""

from __future__ import annotations

from pathlib import Path

from rlexp.rollout.weights import WEIGHTS_FILE, read_shared

# Buffers vLLM computes from the config and never reads from a checkpoint (the rotary
# embeddings' cos/sin tables). vLLM's layer-wise in-place reload counts every tensor of a module
# as a weight to load, so at each sync it found none for the rotary embedding and logged
# "RotaryEmbedding: Failed to load weights" (any model with rope: Llama, Qwen2, Qwen3, ...),
# then put the unchanged table back. Listed as never-loaded, the reload leaves them alone.
DERIVED_BUFFERS = ("cos_sin_cache", "cos_sin_cache_bf16")


def skip_derived_buffers() -> bool:
    """Add DERIVED_BUFFERS to vLLM's own sets of tensors its reload never loads (and never
    moves to the meta device); False if this vLLM has no such sets."""
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


class SharedWeightLoader:
    def load_shared_weights(self, directory: str) -> None:
        """Reload the weights in place from views of the transport's mapped file: vLLM's own
        reload path (its name mapping, fused layers and CPU weight repacking), without
        parsing or copying the file first."""
        self.reload_weights(weights_iterator=read_shared(Path(directory) / WEIGHTS_FILE))  # type: ignore[attr-defined]


    def set_idle_spin(self, seconds: float) -> int:
        """After its last message, vLLM's worker keeps polling its input queue in a busy loop
        (`sched_yield`) for a hard-coded second before it sleeps on a socket. On a CPU machine
        that second is stolen from the trainer's fit, which starts right after rollout. vLLM
        has no setting for it, so this sets the reader's `busy_loop_s` (an attribute of its
        internal SpinCondition); returns how many it set (0 if vLLM renamed it)."""
        import gc

        try:
            from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
        except ImportError:
            return 0
        # type(), not isinstance(): isinstance dereferences weak proxies, which may be dead
        readers = [o for o in gc.get_objects() if issubclass(type(o), SpinCondition) and o.is_reader]
        for r in readers:
            r.busy_loop_s = seconds
        return len(readers)


# vLLM imports this module in each of its workers (as the worker extension) before any weight
# update, whichever way the update comes (this loader, vLLM's own reload, vLLM's IPC transfer).
skip_derived_buffers()
