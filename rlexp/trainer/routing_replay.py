"""Rollout routing replay (R3): the trainer's MoE layers route each token to the experts the
inference engine chose for it, so the importance ratio compares the same computation.

Routing replay, as in "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers" (Ma et al., 2025, arXiv:2510.11370): for token t at layer l the engine chose
the experts E_{t,l} (top-k of its router). The trainer keeps its own router logits z_{t,l}
(so the router still gets a gradient) but takes E_{t,l} instead of its own top-k:

    p = softmax(z),  w_e = p_e / sum_{e' in E} p_{e'} for e in E   (norm_topk_prob, Qwen3-MoE)
    y = sum_{e in E} w_e * expert_e(x)

Works on transformers' Qwen3-MoE (`mlp.gate`: a top-k router returning logits, weights and
indices) through a forward hook, a public PyTorch API: the hook replaces the router's weights
and indices and keeps its logits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order (modules with `top_k` and `num_experts` named
    `...mlp.gate`); empty for a dense model."""
    return [m for name, m in model.named_modules()
            if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def replayed(router_logits: torch.Tensor, ids: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The routing weights of the given experts `ids` [rows, k] under `router_logits`
    [rows, experts]: softmax probabilities at `ids`, renormalised over them when `normalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, ids)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(router_logits.dtype)


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor, replay: bool = True,
                   differs: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Within the block, every forward of `model` routes position t of row b at layer l to
    `routed[b, t, l]` ([rows, positions, layers, k] expert ids, matching the forward's
    input_ids [rows, positions]); with `replay` False it routes freely. Either way, when
    `differs` is given each forward appends [rows, positions, layers] bool: whether the
    model's own top-k differs from `routed` there (as sets)."""
    layers = routers(model)
    if routed.shape[2] != len(layers):
        raise ValueError(f"routing replay: {routed.shape[2]} layers of routing for a model with "
                         f"{len(layers)} MoE layers")
    per_layer: list[torch.Tensor] = []

    def hook(layer: int):
        def replace(module, args, output):
            logits, _, own = output
            ids = routed[:, :, layer].reshape(-1, routed.shape[-1]).to(logits.device, torch.long)
            if ids.shape[0] != logits.shape[0]:
                raise ValueError(f"routing replay: {ids.shape[0]} routed positions for a forward of "
                                 f"{logits.shape[0]}")
            if differs is not None:
                per_layer.append((own.sort(-1).values != ids.sort(-1).values).any(-1))
            return (logits, replayed(logits, ids, module.norm_topk_prob), ids) if replay else None
        return replace

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        if differs is not None and per_layer:
            first = per_layer[:len(layers)]  # a recomputing (checkpointed) backward runs the hooks again
            differs.append(torch.stack(first, dim=-1).reshape(*routed.shape[:2], len(layers)))


def routed_forward(model: torch.nn.Module, ids: torch.Tensor, routed: torch.Tensor | None, replay: bool):
    """`model(input_ids=ids)` under the engine's routing `routed` [rows, positions, layers, k]
    (replayed, or only compared when `replay` is False), and per predicting position the
    share of MoE layers whose own top-k differs from the engine's, [rows, positions - 1]
    (None without routing)."""
    if routed is None:
        return model(input_ids=ids, use_cache=False), None
    differs: list[torch.Tensor] = []
    with replay_routing(model, routed, replay, differs):
        out = model(input_ids=ids, use_cache=False)
    return out, differs[0][:, :-1].float().mean(-1) if differs else None
