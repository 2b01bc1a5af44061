"""The receiving half inside vLLM's worker processes: what rlexp's worker extension
(rlexp/rollout/vllm_worker.py, vLLM's `worker_extension_cls`) runs when a sync arrives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlexp.weights import vllm_private
from rlexp.weights.files import WEIGHTS_FILE, read_shared


def load_shared_weights(worker: Any, directory: str) -> None:
    """Reload `worker`'s weights in place from views of the transport's mapped file: vLLM's
    own reload path (its name mapping, fused layers and CPU weight repacking), without parsing
    or copying the file first; then the CPU MoE experts' repack vLLM skips on a reload."""
    worker.reload_weights(weights_iterator=read_shared(Path(directory) / WEIGHTS_FILE))
    vllm_private.repack_moe_experts(worker.model_runner.get_model())


# vLLM imports this module in each of its workers (through the worker extension) before any
# weight update, whichever way the update comes (this loader, vLLM's own reload, vLLM's IPC).
vllm_private.skip_derived_buffers()
