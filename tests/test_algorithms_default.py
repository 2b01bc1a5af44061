"""The default composition computes bit for bit what direct, uncomposed formulas compute: GRPO's
group-normalized advantages, PPO-clip, the TIS and decoupled corrections and the k3 KL, each
written out here as the reference (same seed, same numbers)."""

from collections import defaultdict

import pytest
import torch

from rlexp.algorithms.advantages import AdvantageInputs, GroupNormalized
from rlexp.algorithms.mismatch import TIS, Decoupled, NoCorrection
from rlexp.algorithms.objective import KLTerm, Objective, PPOClip, TokenInputs, TokenMean, Totals


def group_advantages(rewards, group_ids, norm_by_std=True, eps=1e-6):
    index = defaultdict(list)
    for i, g in enumerate(group_ids):
        index[g].append(i)
    adv = torch.zeros_like(rewards, dtype=torch.float32)
    for members in index.values():
        r = rewards[members].float()
        centered = r - r.mean()
        if norm_by_std and len(members) > 1:
            centered = centered / (r.std(unbiased=False) + eps)
        adv[members] = centered
    return adv


def clipped_pg_loss(logp, old_logp, adv, clip_low, clip_high):
    ratio = torch.exp(logp - old_logp)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, ratio.detach(), (clipped > unclipped).float()


def truncated_is_pg_loss(logp, rollout_logp, adv, cap):
    ratio = torch.exp(logp - rollout_logp).detach()
    weight = torch.clamp(ratio, max=cap)
    return -weight * adv * logp, ratio, (ratio > cap).float()


def k3_kl(logp, ref_logp):
    delta = ref_logp - logp
    return torch.expm1(delta) - delta  # exp(delta) - 1 - delta, without cancellation near 0


def totals_of(mask):
    return Totals(tokens=float(mask.sum()), seqs=float((mask.sum(-1) > 0).sum()))


@pytest.mark.parametrize("correction", ["none", "tis", "decoupled"])
@pytest.mark.parametrize("kl_coef,entropy_coef", [(0.0, 0.0), (0.05, 0.01)])
def test_default_composition_matches_the_reference_formulas(correction, kl_coef, entropy_coef):
    """GroupNormalized("population"), PPOClip(0.2, 0.2), TokenMean(), KLTerm("k3", 0.0),
    NoCorrection() (and the `tis` and `decoupled` corrections, the KL and entropy terms) give
    bit-identical advantages, losses, metrics and gradients to the reference formulas above
    (group_advantages, clipped_pg_loss, truncated_is_pg_loss, k3_kl), composed by hand."""
    g = torch.Generator().manual_seed(2)
    n, T = 10, 9
    rewards = torch.randint(0, 2, (n,), generator=g).float()
    rewards[3] = 0.5
    groups = [0, 0, 0, 1, 1, 1, 1, 2, 3, 3]
    completed = torch.ones(n, dtype=torch.bool)
    completed[5] = False
    lengths = [9, 4, 6, 1, 8, 0, 3, 5, 7, 2]
    mask = torch.tensor([[1.0] * k + [0.0] * (T - k) for k in lengths])
    logp0 = -3 * torch.rand(n, T, generator=g)
    old = logp0 + 0.3 * torch.randn(n, T, generator=g)
    behav = old + 0.3 * torch.randn(n, T, generator=g)
    ref = logp0 + 0.3 * torch.randn(n, T, generator=g)
    ent = 2 * torch.rand(n, T, generator=g)
    n_tokens = float(mask.sum())

    # the reference: the formulas above, composed by hand
    old_adv = group_advantages(rewards, [gi if ok else ("excluded", i)
                                         for i, (gi, ok) in enumerate(zip(groups, completed.tolist()))], True)
    logp_a = logp0.clone().requires_grad_()
    if correction == "tis":
        pg, ratio, clipped = truncated_is_pg_loss(logp_a, behav, old_adv[:, None], 2.0)
    else:
        pg, ratio, clipped = clipped_pg_loss(logp_a, old, old_adv[:, None], 0.2, 0.2)
    if correction == "decoupled":
        pg = pg * torch.exp(old - behav).clamp(max=2.0)
    loss_a = pg - entropy_coef * ent if entropy_coef else pg
    kl_a = k3_kl(logp_a, ref)
    if kl_coef > 0:
        loss_a = loss_a + kl_coef * kl_a
    total_a = (loss_a * mask).sum() / n_tokens
    (grad_a,) = torch.autograd.grad(total_a, logp_a)

    # the composition under test
    policy_loss = {"none": PPOClip(0.2, 0.2), "tis": TIS(2.0),
                   "decoupled": Decoupled(0.2, 0.2, 2.0)}[correction]
    obj = Objective(GroupNormalized("population"), policy_loss, TokenMean(), KLTerm("k3", kl_coef),
                    NoCorrection(), entropy_coef=entropy_coef)
    adv, _ = obj.advantages(AdvantageInputs(rewards, groups, completed, mask))
    assert torch.equal(adv, old_adv[:, None].expand(n, T))
    logp_b = logp0.clone().requires_grad_()
    loss_b, m = obj.token_loss(TokenInputs(logp_b, old, behav, adv, mask), ent, ref)
    total_b = obj.aggregate(loss_b, mask, totals_of(mask))
    (grad_b,) = torch.autograd.grad(total_b, logp_b)

    assert torch.equal(loss_b, loss_a)
    assert torch.equal(total_b, total_a)
    assert torch.equal(grad_b, grad_a)
    assert torch.equal(m["pg_loss"], pg.detach())
    assert torch.equal(m["kl"], kl_a.detach())
    assert torch.equal(m["ratio_mean"], ratio)
    assert torch.equal(m["clip_frac"], clipped)
