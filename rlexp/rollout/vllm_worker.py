"""rlexp's methods in each vLLM worker (vLLM's `worker_extension_cls`, which vLLM adds to its
worker class), called from the engine with `AsyncLLM.collective_rpc`. Each forwards to the
module that owns the concept: weights (rlexp/weights/vllm_worker.py), the idle spin
(rlexp/weights/vllm_private.py), routing capture (rlexp/rollout/vllm_routing.py)."""

from __future__ import annotations

from rlexp.rollout import vllm_routing
from rlexp.weights import vllm_private
from rlexp.weights import vllm_worker as weights


class WorkerExtension:
    model_runner: object

    def load_shared_weights(self, directory: str) -> None:
        weights.load_shared_weights(self, directory)

    def set_idle_spin(self, seconds: float) -> int:
        """How long the worker busy-polls after its last message; how many readers it set."""
        return vllm_private.set_idle_spin(seconds)

    def enable_routing_capture(self) -> int:
        """Capture every MoE layer's expert choice per token; the number of MoE layers."""
        return vllm_routing.install(self.model_runner)

    def take_routing(self, request_ids: list[str]) -> dict:
        """The finished requests' routing, by the ids the engine gave them."""
        return vllm_routing.take(self.model_runner, request_ids)
