"""rlexp.algorithms: aggregations and the composed Objective, against the papers' formulas on
small hand-made inputs; micro-batch/rank exactness of the aggregations and of every composed
loss; finiteness of every composition far off-policy. (Advantage estimators:
test_algorithms_advantages.py; policy losses, mismatch corrections, KL:
test_algorithms_losses.py; the default composition against direct reference formulas:
test_algorithms_default.py.)"""

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from rlexp.algorithms.advantages import (
    AdvantageInputs,
    GroupNormalized,
    LeaveOneOut,
    ReinforcePP,
    ReinforcePPBaseline,
)
from rlexp.algorithms.mismatch import TIS, Decoupled, IcePop, NoCorrection, SeqMask, SeqTIS, TokenTIS
from rlexp.algorithms.objective import (
    CISPO,
    GSPO,
    KLTerm,
    Objective,
    PPOClip,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    TokenInputs,
    TokenMean,
    Totals,
)
from tests.algorithm_helpers import adv_inputs, t

# ---------------------------------------------------------------- aggregation

AGGREGATIONS = [TokenMean(), SeqMeanTokenSum(), SeqMeanTokenMean(), SeqMeanTokenSumNorm(norm_length=16)]


def totals_of(mask: torch.Tensor) -> Totals:
    return Totals(tokens=float(mask.sum()), seqs=float((mask.sum(-1) > 0).sum()))


@pytest.mark.parametrize("agg,value,row_grads", [
    (TokenMean(), 10 / 4, [1 / 4, 1 / 4]),  # sum / N
    (SeqMeanTokenSum(), 10 / 2, [1 / 2, 1 / 2]),  # sum / S
    (SeqMeanTokenMean(), (6 / 3 + 4 / 1) / 2, [1 / 6, 1 / 2]),  # mean_i (sum_t / T_i)
    (SeqMeanTokenSumNorm(norm_length=4), 10 / (2 * 4), [1 / 8, 1 / 8]),  # sum / (S * L)
])
def test_aggregation_values_and_gradients(agg, value, row_grads):
    loss = t([[1, 2, 3], [4, 100, 100], [100, 100, 100]]).requires_grad_()
    mask = t([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the empty row does not count as a sequence
    totals = totals_of(mask)
    assert totals == Totals(tokens=4.0, seqs=2.0)
    out = agg(loss, mask, totals)
    assert_close(out, torch.tensor(value))
    (g,) = torch.autograd.grad(out, loss)
    assert_close(g, t([[row_grads[0]] * 3, [row_grads[1], 0, 0], [0, 0, 0]]))


def exactness_batch(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 0, 5, 1, 6]  # row 2: an empty response
    mask = torch.tensor([[1.0] * n + [0.0] * (7 - n) for n in lengths], dtype=dtype)
    return mask, g


# micro-batches of one minibatch; and two "ranks" (disjoint rows), each in micro-batches
SPLITS = {"micro_batches": [[0, 1], [2], [3, 4, 5]],
          "two_ranks": [[0], [2, 4], [1, 3], [5]]}


def pieces(rows, mask):
    """A micro-batch's rows, trimmed to its longest trained row (as the trainer packs them)."""
    idx = torch.tensor(rows)
    width = max(1, int(mask[idx].sum(-1).max()))
    return idx, slice(0, width)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("agg", AGGREGATIONS, ids=lambda a: type(a).__name__)
def test_aggregation_is_exact_over_micro_batches_and_ranks(agg, split):
    mask, g = exactness_batch()
    loss = torch.randn(mask.shape, generator=g, dtype=torch.float64).requires_grad_()
    totals = totals_of(mask)  # over the whole minibatch
    whole = agg(loss, mask, totals)
    (g_whole,) = torch.autograd.grad(whole, loss)
    parts = []
    for rows in SPLITS[split]:
        idx, cols = pieces(rows, mask)
        parts.append(agg(loss[idx, cols], mask[idx, cols], totals))
    summed = torch.stack(parts).sum()
    (g_parts,) = torch.autograd.grad(summed, loss)
    assert_close(summed, whole, rtol=1e-12, atol=1e-12)
    assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-12)


POLICY_LOSSES = [PPOClip(0.2, 0.28, dual_clip=3.0), PPOClip(0.2, 0.2), GSPO(), GSPO(0.2, 0.2), CISPO(),
                 TIS(2.0), Decoupled(0.2, 0.2, is_cap=2.0)]
MISMATCHES = [NoCorrection(), TokenTIS(2.0), SeqTIS(2.0), IcePop(0.5, 2.0),
              SeqMask(0.5, 2.0, geometric=True), SeqMask(0.5, 2.0, geometric=False)]


def test_objective_is_exact_over_micro_batches_and_ranks():
    """Every policy loss x mismatch x aggregation (KL and entropy in the loss): the pieces'
    losses and gradients w.r.t. logp sum to the whole minibatch's."""
    mask, g = exactness_batch()
    n, T = mask.shape
    logp0 = -3 * torch.rand(n, T, generator=g, dtype=torch.float64)
    old = logp0 + 0.4 * torch.randn(n, T, generator=g, dtype=torch.float64)
    behav = old + 0.4 * torch.randn(n, T, generator=g, dtype=torch.float64)
    ref = logp0 + 0.4 * torch.randn(n, T, generator=g, dtype=torch.float64)
    entropy = torch.rand(n, T, generator=g, dtype=torch.float64)
    x_adv = adv_inputs([1, 0, 1, 0, 0, 1], groups=[0, 0, 0, 1, 1, 1], mask=mask.tolist())
    adv = GroupNormalized()(x_adv).double()
    totals = totals_of(mask)

    def run(obj, idx, cols, logp):
        x = TokenInputs(logp[idx, cols], old[idx, cols], behav[idx, cols], adv[idx, cols], mask[idx, cols])
        loss, _ = obj.token_loss(x, entropy[idx, cols], ref[idx, cols])
        return obj.aggregate(loss, x.mask, totals)

    for loss_fn, mismatch, agg in itertools.product(POLICY_LOSSES, MISMATCHES, AGGREGATIONS):
        obj = Objective(GroupNormalized(), loss_fn, agg, KLTerm("k3", 0.1), mismatch, entropy_coef=0.01)
        logp = logp0.clone().requires_grad_()
        whole = run(obj, torch.arange(n), slice(0, T), logp)
        (g_whole,) = torch.autograd.grad(whole, logp)
        for split in SPLITS.values():
            logp = logp0.clone().requires_grad_()
            summed = torch.stack([run(obj, *pieces(rows, mask), logp) for rows in split]).sum()
            (g_parts,) = torch.autograd.grad(summed, logp)
            name = f"{type(loss_fn).__name__} {type(mismatch).__name__} {type(agg).__name__}"
            assert_close(summed, whole, rtol=1e-12, atol=1e-12, msg=name)
            assert_close(g_parts, g_whole, rtol=1e-12, atol=1e-12, msg=name)


# ---------------------------------------------------------------- Objective


def test_objective_composes_weight_entropy_and_kl():
    # PPO-clip: r = [1.1, 1.0], A = [1, -1] -> pg [-1.1, 1.0]; TokenTIS: rho = [3, 0.5] -> w [2, 0.5]
    # -> [-2.2, 0.5]; entropy bonus 0.1 * [2, 1]; KL k1 (log r = ref - logp = [0, 1]) = [0, -1], coef 0.5
    logp = t([-1.0, -2.0]).requires_grad_()
    old = t([-1.0 - math.log(1.1), -2.0])
    behav = old - t([math.log(3.0), math.log(0.5)])
    x = TokenInputs(logp, old, behav, adv=t([1.0, -1.0]), mask=t([1.0, 1.0]))
    obj = Objective(GroupNormalized(), PPOClip(0.2, 0.2), TokenMean(), KLTerm("k1", 0.5), TokenTIS(2.0),
                    entropy_coef=0.1)
    assert obj.needs_recompute
    loss, m = obj.token_loss(x, t([2.0, 1.0]), logp.detach() + t([0.0, 1.0]))
    assert_close(loss, t([-2.2 - 0.2 + 0.0, 0.5 - 0.1 - 0.5]))
    assert_close(m["pg_loss"], t([-2.2, 0.5]))
    assert_close(m["kl"], t([0.0, -1.0]))
    assert_close(m["is_weight_mean"], t([2.0, 0.5]))
    assert_close(m["loss"], loss)
    (g,) = torch.autograd.grad(obj.aggregate(loss, x.mask, Totals(2.0, 1.0)), logp)
    # (w * (-A r) + 0.5 * d k1/dlogp) / N = ([-2.2, 0.5] + 0.5) / 2
    assert_close(g, t([-1.7 / 2, 1.0 / 2]))


def test_objective_mask_zeroes_the_whole_loss_of_masked_tokens():
    # IcePop: rho = [1.5, 3] -> weight [1.5, 0], keep [1, 0]; the kept token's policy-gradient
    # loss is weighted by rho, the masked token's whole loss (policy, KL in the loss and entropy
    # terms) and its gradient are 0. PPO-clip: r = 1.1 (inside the clip), A = 1: -1.1 per token.
    logp = t([-1.0, -2.0]).requires_grad_()
    old = t([-1.0 - math.log(1.1), -2.0 - math.log(1.1)])
    x = TokenInputs(logp, old, old - t([math.log(1.5), math.log(3.0)]), adv=t([1.0, 1.0]), mask=t([1.0, 1.0]))
    obj = Objective(GroupNormalized(), PPOClip(0.2, 0.2), TokenMean(), KLTerm("k3", 0.0), IcePop(0.5, 2.0))
    loss, m = obj.token_loss(x, None, None)
    assert_close(loss, t([-1.65, 0.0]))  # 1.5 * -1.1
    assert_close(m["pg_loss"], t([-1.65, 0.0]))
    assert m["masked_token_frac"].tolist() == [0.0, 1.0]
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(g, t([-1.65, 0.0]))  # d(-1.5 r A)/dlogp = -1.5 r
    with_terms = Objective(GroupNormalized(), PPOClip(0.2, 0.2), TokenMean(), KLTerm("k1", 0.5),
                           IcePop(0.5, 2.0), entropy_coef=0.1)
    loss, _ = with_terms.token_loss(x, entropy=t([2.0, 2.0]), ref_logp=t([-1.0, -1.0]))
    assert_close(loss, t([-1.65 - 0.1 * 2.0 + 0.5 * 0.0, 0.0]))  # k1 = logp - ref = 0 on token 0
    (g,) = torch.autograd.grad(loss.sum(), logp)
    assert_close(g, t([-1.65 + 0.5, 0.0]))


def test_objective_kl_placement():
    logp = t([-1.0, -2.0]).requires_grad_()
    x = TokenInputs(logp, logp.detach(), logp.detach(), adv=t([1.0, 1.0]), mask=t([1.0, 1.0]))
    ref = logp.detach() + 1.0  # log r = 1: k3 = e - 2
    in_reward = Objective(GroupNormalized(), PPOClip(), TokenMean(), KLTerm("k3", 0.5, "reward"),
                          NoCorrection())
    assert not in_reward.needs_recompute
    loss, m = in_reward.token_loss(x, None, ref)
    assert_close(m["kl"], t([math.e - 2] * 2))
    assert_close(loss, t([-1.0, -1.0]))  # logged, not in the loss
    in_loss = Objective(GroupNormalized(), PPOClip(), TokenMean(), KLTerm("k3", 0.5), NoCorrection())
    loss, m = in_loss.token_loss(x, None, ref)
    assert_close(loss, t([-1.0 + 0.5 * (math.e - 2)] * 2))
    loss, m = in_loss.token_loss(x, None, None)  # no reference this step
    assert "kl" not in m
    assert_close(loss, t([-1.0, -1.0]))
    assert Objective(GroupNormalized(), Decoupled(), TokenMean(), KLTerm(), NoCorrection()).needs_recompute


# ---------------------------------------------------------------- far off-policy: every composition

ADVANTAGES = [GroupNormalized("population"), GroupNormalized("sample"), GroupNormalized("none"),
              LeaveOneOut(), ReinforcePP(), ReinforcePPBaseline()]
KLS = [KLTerm(e, coef=0.1, where=w) for e in ("k1", "k2", "k3", "low_var_kl") for w in ("loss", "reward")]


def far_off_batch():
    """8 rows x 6 tokens. Groups: rows 0-2 (row 2 an empty response), rows 3-4 (equal rewards),
    row 5 alone, rows 6-7 (row 7 failed). logp/old/behav/ref each offset by up to +-25 from a
    common base, so that every pair's |log-ratio| reaches 50."""
    g = torch.Generator().manual_seed(1)
    n, T = 8, 6
    offsets = t([-25.0, -10.0, -0.1, 0.0, 0.1, 10.0, 25.0])
    base = -5 * torch.rand(n, T, generator=g)
    logp, old, behav, ref = (base + offsets[torch.randint(0, 7, (n, T), generator=g)] for _ in range(4))
    logp[0, :4], old[0, :4], behav[0, :4], ref[0, :4] = t([25, -25, 25, -25]), t([-25, 25, 25, -25]), \
        t([-25, -25, 25, 25]), t([25, 25, -25, 25])
    lengths = [6, 4, 0, 5, 3, 2, 6, 6]
    mask = torch.tensor([[1.0] * k + [0.0] * (T - k) for k in lengths])
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    groups = [0, 0, 0, 1, 1, 2, 3, 3]
    completed = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    entropy = 3 * torch.rand(n, T, generator=g)
    return logp, old, behav, ref, mask, t(rewards), groups, completed, entropy


def test_every_composition_is_finite_far_off_policy():
    logp0, old, behav, ref, mask, rewards, groups, completed, entropy = far_off_batch()
    for a, b in itertools.combinations([logp0, old, behav, ref], 2):
        assert abs(((a - b) * mask).abs().max() - 50) < 1e-3
    totals = totals_of(mask)
    bad = []
    for est, kl in itertools.product(ADVANTAGES, KLS):
        token_rewards = kl.token_rewards(behav, ref, mask) if kl.in_reward else None
        x_adv = AdvantageInputs(rewards, groups, completed, mask, token_rewards)
        for loss_fn, mismatch, agg in itertools.product(POLICY_LOSSES, MISMATCHES, AGGREGATIONS):
            name = f"{type(est).__name__}/{kl.estimator}-{kl.where}/{type(loss_fn).__name__}/" \
                   f"{type(mismatch).__name__}/{type(agg).__name__}"
            obj = Objective(est, loss_fn, agg, kl, mismatch, entropy_coef=0.01)
            adv, _ = obj.advantages(x_adv)
            logp = logp0.clone().requires_grad_()
            loss, metrics = obj.token_loss(TokenInputs(logp, old, behav, adv, mask), entropy, ref)
            total = obj.aggregate(loss, mask, totals)
            (g,) = torch.autograd.grad(total, logp)
            finite = [torch.isfinite(adv).all(), torch.isfinite(total), torch.isfinite(g).all()]
            finite += [torch.isfinite(v).all() for v in metrics.values() if v is not None]
            if not all(finite):
                bad.append(name)
    assert not bad, f"{len(bad)} compositions not finite, e.g. {bad[:5]}"
