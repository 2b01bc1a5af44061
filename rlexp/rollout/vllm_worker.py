"""Runs inside vLLM's worker processes (vLLM's `worker_extension_cls`): the methods here
are added to each worker and called with `AsyncLLM.collective_rpc`."""

from __future__ import annotations

from pathlib import Path

from rlexp.rollout.weights import WEIGHTS_FILE, read_shared


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
