"""MoE routing without an engine: how a trace stitches its generations' routing
(rlexp/sample.py: stitch_routing), the expert-load metrics (rlexp/metrics.py), the router's
load-balancing loss and replay under gradient checkpointing (rlexp/trainer/routing_replay.py)."""

import numpy as np
import pytest

from rlexp.metrics import expert_load, rollout_metrics
from rlexp.sample import Generation, Sample, Status, TokenTrace, stitch_routing
from tests.fakes import UNCHECKED


def test_expert_load_is_the_busiest_experts_share_per_layer_and_counts_the_bytes():
    # two samples' routing [positions, layers=2, k=2]; layer 0 slots: 0,1,0,2 | 0,0 ; layer 1: 2,3,2,3 | 1,3
    a = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 3]]], dtype=np.uint8)
    b = np.array([[[0, 0], [1, 3]]], dtype=np.uint8)
    out = expert_load([a, None, b])
    assert out == {"moe/routing_bytes": 12.0,
                   "moe/expert_load_max/layer_0": 4 / 6,  # expert 0 in 4 of 6 slots
                   "moe/expert_load_max/layer_1": 3 / 6}  # expert 3 in 3 of 6
    assert expert_load([None]) == {}


def test_rollout_metrics_carry_the_expert_load_of_completed_samples_only():
    def sample(routing, status):
        trace = TokenTrace(tokens=[1, 2, 3])
        trace.routed_experts = routing
        return Sample(group_id=0, prompt=[], answer="", trace=trace, status=status)

    busy = np.zeros((2, 1, 2), dtype=np.uint8)  # everything to expert 0
    spread = np.array([[[0, 1]], [[2, 3]]], dtype=np.uint8)
    metrics = rollout_metrics([sample(spread, Status.COMPLETED), sample(busy, Status.FAILED)], version=0)
    assert metrics["moe/expert_load_max/layer_0"] == 0.25 and metrics["moe/routing_bytes"] == 4.0
    assert "moe/routing_bytes" not in rollout_metrics([sample(None, Status.COMPLETED)], version=0)


def _routing(positions: int, value: int) -> np.ndarray:
    return np.full((positions, 2, 2), value, dtype=np.uint8)


def test_a_position_keeps_the_routing_of_the_request_that_first_computed_it():
    first = _routing(4, 1)  # a request over 3 prompt tokens + 2 generated: positions 0..3
    later = _routing(7, 2)  # the next turn's request: the same 5 tokens, 2 more, 1 generated
    stitched = stitch_routing(first, later)
    assert stitched.shape == (7, 2, 2)
    assert (stitched[:4] == 1).all() and (stitched[4:] == 2).all()
    assert stitch_routing(None, later) is later and stitch_routing(first, None) is first
    assert stitch_routing(first, _routing(3, 2)) is first  # a shorter later request adds nothing


def test_a_trace_stitches_its_turns_routing_and_copies_share_it():
    trace = TokenTrace()
    trace.append([5, 6, 7], role="prompt")
    trace.append([8, 9], role="assistant", generation=Generation([8, 9], [-0.1, -0.2], "stop", [0, 0],
                                                                 routed_experts=_routing(4, 1)))
    trace.append([10], role="user")
    trace.append([11], role="assistant", generation=Generation([11], [-0.3], "stop", [1],
                                                               routed_experts=_routing(6, 2)))
    assert trace.routed_experts.shape == (6, 2, 2) and len(trace) == 7  # positions 0..len-2
    assert (trace.routed_experts[:4] == 1).all() and (trace.routed_experts[4:] == 2).all()
    assert trace.copy().routed_experts is trace.routed_experts


# ---- the router's load-balancing loss (rlexp/trainer/routing_replay.py) -------------------

def test_load_balancing_loss_is_the_switch_formula_by_hand_with_its_gradient():
    import torch

    from rlexp.trainer.routing_replay import load_balancing_loss

    # 3 experts, top-1; token 0: p = 1/3 each, token 1: p = (1/2, 1/4, 1/4); both sent to expert 0.
    # A padded row (not real) must not count.
    z = torch.tensor([[0.0, 0.0, 0.0], [0.6931471805599453, 0.0, 0.0], [5.0, -5.0, 9.0]], requires_grad=True)
    ids = torch.tensor([[0], [0], [2]])
    real = torch.tensor([True, True, False])
    loss = load_balancing_loss([z], [ids], real)
    # f = (1, 0, 0), P = (5/12, 7/24, 7/24): L = 3 * 5/12 = 1.25
    assert abs(loss.item() - 1.25) < 1e-6
    loss.backward()
    # dL/dz_tj = (E/T) p_tj (f_j - sum_e f_e p_te)
    expected = torch.tensor([[1 / 3, -1 / 6, -1 / 6], [0.375, -0.1875, -0.1875], [0.0, 0.0, 0.0]])
    assert torch.allclose(z.grad, expected, atol=1e-6)
    # uniform routing and probabilities: 1; two layers average
    flat, even, two = torch.zeros(2, 2), torch.tensor([[0], [1]]), torch.ones(2, dtype=torch.bool)
    both = load_balancing_loss([flat, z[:2].detach()], [even, ids[:2]], two)
    assert abs(load_balancing_loss([flat], [even], two).item() - 1.0) < 1e-6
    assert abs(both.item() - (1.0 + 1.25) / 2) < 1e-6


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    from rlexp.models.arch import build_arch_model

    return build_arch_model("qwen3_moe", str(tmp_path_factory.mktemp("moe")), seed=0)


def _batch(rewards: list[float], routing: int | None = None) -> list[Sample]:
    out = []
    for i, r in enumerate(rewards):
        tokens = [5 + (7 * i + 3 * j) % 90 for j in range(10 + i)]
        trace = TokenTrace(tokens, [0] * 4 + [1] * (len(tokens) - 4), [0.0] * 4 + [-1.0] * (len(tokens) - 4),
                           [0] * len(tokens))
        if routing is not None:
            trace.routed_experts = np.stack([np.full((len(tokens) - 1, 2), [routing, routing + 1])] * 2
                                            ).transpose(1, 0, 2).astype(np.uint8)
        out.append(Sample(group_id=0, prompt=tokens[:4], answer="", trace=trace, status=Status.COMPLETED,
                          reward=r))
    return out


def _trainer(path: str, lr: float, **kw):
    from functools import partial

    import torch

    from rlexp.trainer.controller import TrainController

    torch.manual_seed(0)
    return TrainController(path, temperature=1.0, total_steps=50, ref_kl_every_n_steps=0,
                           optimizer=partial(torch.optim.SGD, lr=lr), sync_check=UNCHECKED, **kw)


def _router_logits(model, batch, ids=None):
    """Per layer, transformers' `router_logits` over the batch's predicting positions (all but
    each row's last), one row at a time, each position routed to `ids` when given."""
    import torch

    from rlexp.trainer.routing_replay import replay_routing

    per_sample = []
    for s in batch:
        routed = None if ids is None else ids[:len(s.tokens)][None, :, None].expand(1, -1, 2, -1)
        with torch.no_grad(), replay_routing(model, routed, replay=routed is not None):
            out = model(input_ids=torch.tensor([s.tokens]), output_router_logits=True).router_logits
        per_sample.append([z[:-1] for z in out])
    return [torch.cat(z) for z in zip(*per_sample)]


def test_the_reported_aux_loss_is_the_formula_on_the_models_router_logits(moe_path):
    """One micro-batch: train/router_aux_loss equals L_aux computed from transformers' own
    `output_router_logits` (its top-k); under replay of fixed ids, from those ids."""
    import torch

    from rlexp.trainer.routing_replay import load_balancing_loss

    batch = _batch([0.0, 1.0, 0.0, 1.0])
    trainer = _trainer(moe_path, lr=0.0, router_aux_loss_coef=0.01)
    reported = trainer.fit(batch, version=0)["train/router_aux_loss"]
    logits = _router_logits(trainer.model, batch)
    k, every = trainer.model.config.num_experts_per_tok, torch.ones(logits[0].shape[0], dtype=torch.bool)
    expected = load_balancing_loss(logits, [z.topk(k, -1).indices for z in logits], every)
    assert reported == pytest.approx(expected.item(), rel=1e-5)
    assert 1.0 < reported < 8.0  # 1 when perfectly balanced, 8 (= experts) when one expert takes all

    fixed = _trainer(moe_path, lr=0.0, router_aux_loss_coef=0.01, routing_replay="rollout")
    replayed = fixed.fit(_batch([0.0, 1.0, 0.0, 1.0], routing=2), version=0)["train/router_aux_loss"]
    ids = torch.tensor([[2, 3]]).expand(len(every), 2)
    logits = _router_logits(fixed.model, batch, ids)
    assert replayed == pytest.approx(load_balancing_loss(logits, [ids, ids], every).item(), rel=1e-5)


def test_the_aux_loss_moves_the_router_off_its_busy_experts_and_is_refused_for_a_dense_model(
        moe_path, tiny_model_path):
    """Every position replayed to experts 2 and 3 (f fixed) and no policy signal (equal rewards):
    only the aux loss moves the weights, and its descent must take probability off those two
    experts, so L_aux = 8 * (P_2 + P_3) / 2 falls every step (measured: 1.00, 0.84, 0.68, 0.52,
    0.40). Without the aux loss the step is skipped; a dense model refuses the option by name."""
    trainer = _trainer(moe_path, lr=0.05, router_aux_loss_coef=1.0, routing_replay="rollout")
    curve = [trainer.fit(_batch([1.0] * 4, routing=2), version=v)["train/router_aux_loss"] for v in range(5)]
    assert all(b < a - 0.05 for a, b in zip(curve, curve[1:])), curve
    idle = _trainer(moe_path, lr=0.05, routing_replay="rollout")
    assert idle.fit(_batch([1.0] * 4, routing=2), version=0)["train/skipped_step"] == 1.0
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.5 needs an MoE model"):
        _trainer(tiny_model_path, lr=0.1, router_aux_loss_coef=0.5)


def test_gradient_checkpointing_recomputes_under_the_same_replayed_routing(moe_path):
    """A checkpointed layer re-runs its routers inside backward: they must route as in the
    forward (else the recomputation differs and torch refuses it, or the gradient is wrong)."""
    weights = []
    for checkpointing in (False, True):
        trainer = _trainer(moe_path, lr=0.05, router_aux_loss_coef=0.1, routing_replay="rollout",
                           gradient_checkpointing=checkpointing)
        trainer.fit(_batch([1.0, 0.0, 0.0, 1.0], routing=2), version=0)
        weights.append({k: v.detach().clone() for k, v in trainer.weights()})
    assert max((weights[0][k] - weights[1][k]).abs().max().item() for k in weights[0]) < 1e-6
