"""The receiving half inside vLLM's worker processes (vLLM's `worker_extension_cls`): the
methods here are added to each worker and called with `AsyncLLM.collective_rpc`."""

from __future__ import annotations

from pathlib import Path

from rlexp.weights import vllm_private
from rlexp.weights.files import WEIGHTS_FILE, read_shared


class SharedWeightLoader:
    def load_shared_weights(self, directory: str) -> None:
        """Reload the weights in place from views of the transport's mapped file: vLLM's own
        reload path (its name mapping, fused layers and CPU weight repacking), without
        parsing or copying the file first."""
        self.reload_weights(weights_iterator=read_shared(Path(directory) / WEIGHTS_FILE))  # type: ignore[attr-defined]
        vllm_private.repack_moe_experts(self.model_runner.get_model())  # type: ignore[attr-defined]

    def set_idle_spin(self, seconds: float) -> int:
        """How long the worker busy-polls after its last message (vllm_private.py); returns
        how many queue readers it set. Here because vLLM takes one extension class per worker."""
        return vllm_private.set_idle_spin(seconds)


# vLLM imports this module in each of its workers (as the worker extension) before any weight
# update, whichever way the update comes (this loader, vLLM's own reload, vLLM's IPC transfer).
vllm_private.skip_derived_buffers()
