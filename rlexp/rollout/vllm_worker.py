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

