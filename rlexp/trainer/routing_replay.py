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
and indices and keeps its logits.

The router's load-balancing loss (`trainer.router_aux_loss_coef`) is the Switch Transformer's
("Switch Transformers", Fedus et al., 2022, eq. 4), per MoE layer l, averaged over layers:

    L_aux = E * sum_e f_e * P_e,   f_e = share of the (token, top-k slot) pairs sent to e,
                                   P_e = mean over tokens of softmax(z_t)_e

over the real (unpadded) positions of one micro-batch, with the experts actually used (the
replayed ones under replay). 1 when routing is uniform; only P carries a gradient. Like
Megatron-LM's and transformers', it is a statistic of the micro-batch: unlike the policy loss
it changes with `micro_batch_tokens` and the number of ranks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


def load_balancing_loss(logits: list[torch.Tensor], ids: list[torch.Tensor],
                        real: torch.Tensor) -> torch.Tensor:
    """L_aux above from each layer's router logits [rows, experts] and used experts
    [rows, k]; `real` [rows] bool marks the positions that count."""
    per_layer = []
    for z, used in zip(logits, ids):
        z, used = z[real], used[real]
        experts = z.shape[-1]
        f = torch.zeros(experts, device=z.device).index_add_(0, used.flatten(), torch.ones(used.numel(),
                                                                                         device=z.device))
        p = torch.softmax(z, dim=-1, dtype=torch.float).mean(0)
        per_layer.append(experts * (f / used.numel() * p).sum())
    return torch.stack(per_layer).mean()


@dataclass
class Routing:
    """What the router hooks do in one forward: route position t of row b at layer l to
    `routed[b, t, l]` ([rows, positions, layers, k] expert ids, matching the forward's
    input_ids [rows, positions]) when `replay`, else freely; record per layer, in `differs`,
    [rows * positions] bool: whether the model's own top-k differs from `routed` there (as
    sets); record in `seen` each layer's router logits and the experts used."""
    routed: torch.Tensor | None
    replay: bool = True
    differs: list[torch.Tensor] | None = None
    seen: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def route(self, layer: int, module: torch.nn.Module, output):
        """A router's forward hook: its output, replaced under replay (None: unchanged)."""
        logits, _, own = output
        used, out = own, None
        if self.routed is not None:
            ids = self.routed[:, :, layer].reshape(-1, self.routed.shape[-1]).to(logits.device, torch.long)
            if ids.shape[0] != logits.shape[0]:
                raise ValueError(f"routing replay: {ids.shape[0]} routed positions for a forward of "
                                 f"{logits.shape[0]}")
            if self.differs is not None:
                self.differs.append((own.sort(-1).values != ids.sort(-1).values).any(-1))
            if self.replay:
                used, out = ids, (logits, replayed(logits, ids, bool(module.norm_topk_prob)), ids)
        if self.seen is not None:
            self.seen.append((logits, used))
        return out


def _hook_routers(model: torch.nn.Module, routing: Callable[[], Routing | None]) -> list:
    """A forward hook on each router that applies `routing()` (nothing when it is None)."""
    def hook(layer: int):
        def run(module, args, output):
            r = routing()
            return r.route(layer, module, output) if r is not None else None
        return run

    return [r.register_forward_hook(hook(i)) for i, r in enumerate(routers(model))]


def _check_layers(model: torch.nn.Module, routed: torch.Tensor | None) -> None:
    layers = len(routers(model))
    if routed is not None and routed.shape[2] != layers:
        raise ValueError(f"routing replay: {routed.shape[2]} layers of routing for a model with "
                         f"{layers} MoE layers")


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor | None,
                   replay: bool = True) -> Iterator[None]:
    """Within the block, every forward of `model` routes each token to the experts `routed`
    gives it ([rows, positions, layers, k], see `Routing`); with `replay` False it routes
    freely. (The trainer keeps its hooks for the whole fit: `MoERouting`.)"""
    _check_layers(model, routed)
    handles = _hook_routers(model, lambda: Routing(routed, replay))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class MoERouting:
    """The trainer's side of an MoE's routing: replay (`trainer.routing_replay`), the routing
    mismatch it measures, the load-balancing loss (`trainer.router_aux_loss_coef`).

    Its router hooks stay on the model: a checkpointed layer (`gradient_checkpointing`)
    re-runs its forward, routers included, inside `backward`, and that recomputation must
    route as the forward did. The hooks apply the routing of the latest `forward` call until
    the model is next called: by `forward` again (its new routing), or by anyone else (a
    forward pre-hook on the model frees the routing: that call routes freely). A forward
    without gradients frees it at once."""

    def __init__(self, model: torch.nn.Module, routing_replay: str, router_aux_loss_coef: float):
        self.n_layers = len(routers(model))
        if router_aux_loss_coef and not self.n_layers:
            raise ValueError(f"trainer.router_aux_loss_coef={router_aux_loss_coef} needs an MoE model: "
                             "this one has no router (mlp.gate with top_k)")
        self.replay, self.aux_coef = routing_replay == "rollout", router_aux_loss_coef
        self.differs: torch.Tensor | None = None  # the last forward's, [rows, positions - 1]
        self.aux: torch.Tensor | None = None  # the last training forward's L_aux
        self._current: Routing | None = None
        self._calling = False  # `forward` is calling the model (its pre-hook keeps the routing)
        self._hooked: set[int] = set()

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], routed: torch.Tensor | None,
                real: torch.Tensor):
        """`model(**inputs)` (`input_ids` [rows, positions], ...) under the engine's routing
        `routed` [rows, positions, layers, k] (replayed, or only compared without replay); sets
        `differs` (per predicting position, the share of MoE layers whose own top-k differs
        from the engine's; None without routing) and, in a forward that records gradients,
        `aux` over the positions `real` [rows, positions]."""
        ids = inputs["input_ids"]
        if not self.n_layers:
            self.differs = self.aux = None
            return model(**inputs, use_cache=False)
        if id(model) not in self._hooked:  # the policy and, without LoRA, the reference copy
            _check_layers(model, routed)
            _hook_routers(model, lambda: self._current)
            model.register_forward_pre_hook(self._model_called)
            self._hooked.add(id(model))
        wants_aux = bool(self.aux_coef) and torch.is_grad_enabled()
        now = self._current = Routing(routed, self.replay, [] if routed is not None else None,
                                      [] if wants_aux else None)
        self._calling = True
        out = model(**inputs, use_cache=False)
        n = self.n_layers  # a recomputing (checkpointed) backward appends to the lists again
        self.differs = (torch.stack(now.differs[:n], -1).reshape(*ids.shape, n)[:, :-1].float().mean(-1)
                        if now.differs else None)
        seen = now.seen[:n] if now.seen else []
        self.aux = (load_balancing_loss([z for z, _ in seen], [e for _, e in seen], real.flatten())
                    if seen else None)
        if not torch.is_grad_enabled():
            self._current = None
        return out

    def _model_called(self, module: torch.nn.Module, args) -> None:
        """The model's forward pre-hook: a call that is not `forward`'s routes freely."""
        if not self._calling:
            self._current = None
        self._calling = False
