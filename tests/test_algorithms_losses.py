"""rlexp.algorithms: policy losses, mismatch corrections and KL estimators, each against its
paper's formula on small hand-made inputs (values and autograd gradients w.r.t. logp)."""

import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.testing import assert_close

from rlexp.algorithms.mismatch import TIS, Decoupled, IcePop, NoCorrection, SeqMask, SeqTIS, TokenTIS
from rlexp.algorithms.objective import (
    CISPO,
    GSPO,
    KLTerm,
    PPOClip,
    TokenInputs,
    clamped_exp,
    kl_estimate,
    seq_log_ratio,
)
from rlexp.config import check_arguments
from rlexp.errors import ConfigError

E = math.e


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def inputs(logp, ratio=None, adv=None, mask=None, old_logp=None, rollout_logp=None) -> TokenInputs:
    """logp a leaf with a gradient; old_logp = logp - log(ratio) unless given."""
    logp = t(logp).requires_grad_()
    if old_logp is None:
        old_logp = logp.detach() - torch.log(t(ratio))
    old_logp = t(old_logp) if not isinstance(old_logp, torch.Tensor) else old_logp
    behav = old_logp.clone() if rollout_logp is None else t(rollout_logp)
    mask = torch.ones_like(logp) if mask is None else t(mask)
    return TokenInputs(logp=logp, old_logp=old_logp, rollout_logp=behav, adv=t(adv), mask=mask)


def grad(loss: torch.Tensor, x: TokenInputs) -> torch.Tensor:
    (g,) = torch.autograd.grad((loss * x.mask).sum(), x.logp)
    return g


# ---------------------------------------------------------------- PPO-clip


def test_ppo_clip_values_gradients_and_clip_frac():
    # A > 0: r = 1.1 inside; r = 1.5 above 1 + 0.2 (clipped); r = 0.5 below 0.8 (unclipped: the
    # min of the objective is the unclipped term). A < 0: r = 0.5 clipped; r = 1.5 unclipped.
    x = inputs([-1.0, -2.0, -0.5, -1.5, -3.0], ratio=[1.1, 1.5, 0.5, 0.5, 1.5], adv=[1, 1, 1, -1, -1])
    loss, m = PPOClip(0.2, 0.2)(x)
    assert_close(loss, t([-1.1, -1.2, -0.5, 0.8, 1.5]))
    assert m["clip_frac"].tolist() == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert_close(m["ratio_mean"], t([1.1, 1.5, 0.5, 0.5, 1.5]))
    assert_close(m["pg_loss"], loss.detach())
    # d(-A r)/dlogp = -A r where unclipped, 0 where clipped
    assert_close(grad(loss, x), t([-1.1, 0.0, -0.5, 0.0, 1.5]))


def test_ppo_clip_higher_is_asymmetric():
    # r = 1.25, A > 0: clipped by high = 0.2, not by high = 0.28 (DAPO's clip-higher);
    # r = 0.75, A < 0: clipped by low = 0.2 in both
    x = inputs([-1.0, -1.0], ratio=[1.25, 0.75], adv=[2.0, -1.0])
    sym, _ = PPOClip(0.2, 0.2)(x)
    assert_close(sym, t([-2.4, 0.8]))
    assert_close(grad(sym, x), t([0.0, 0.0]))
    x = inputs([-1.0, -1.0], ratio=[1.25, 0.75], adv=[2.0, -1.0])
    asym, m = PPOClip(0.2, 0.28)(x)
    assert_close(asym, t([-2.5, 0.8]))
    assert m["clip_frac"].tolist() == [0.0, 1.0]
    assert_close(grad(asym, x), t([-2.5, 0.0]))


def test_ppo_dual_clip_bounds_negative_advantages_with_huge_ratios():
    # A = -1, r = e^10: PPO's loss is -A r = 22026, dual-clip bounds it at -A c = 3 (no grad);
    # A = -1, r = 2: 2 < 3, untouched; A = +1, r = e^10: the usual clip (-1.2), dual does
    # not apply; A = -2, r = 5: 10 -> 6.
    x = inputs([-1.0, -1.0, -1.0, -1.0], old_logp=[-11.0, -1.0 - math.log(2.0), -11.0, -1.0 - math.log(5.0)],
               adv=[-1.0, -1.0, 1.0, -2.0])
    plain, _ = PPOClip(0.2, 0.2)(x)
    assert_close(plain, t([math.exp(10), 2.0, -1.2, 10.0]))
    loss, m = PPOClip(0.2, 0.2, dual_clip=3.0)(x)
    assert_close(loss, t([3.0, 2.0, -1.2, 6.0]))
    assert m["dual_clip_frac"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert_close(m["pg_loss"], loss.detach())
    assert_close(grad(loss, x), t([0.0, 2.0, 0.0, 0.0]))


def check(target: str, **kwargs) -> None:
    check_arguments(OmegaConf.create({"_target_": target, **kwargs}))


def test_ppo_dual_clip_must_exceed_one():
    check("rlexp.algorithms.objective.PPOClip", dual_clip=3.0)
    check("rlexp.algorithms.objective.PPOClip", dual_clip=None)
    with pytest.raises(ConfigError):
        check("rlexp.algorithms.objective.PPOClip", dual_clip=1.0)


def test_ppo_ratio_is_clamped_at_exp_20():
    x = inputs([0.0, 0.0], old_logp=[-50.0, 50.0], adv=[-1.0, 1.0])
    loss, m = PPOClip(0.2, 0.2)(x)
    assert_close(m["ratio_mean"], t([math.exp(20), math.exp(-20)]))
    # A = -1, r = e^20 (clamped): -A r; A = +1, r = e^-20: -A r (below 1 - low, unclipped term)
    assert_close(loss, t([math.exp(20), -math.exp(-20)]))
    g = grad(loss, x)
    assert torch.isfinite(g).all() and g.tolist() == [0.0, 0.0]  # beyond the clamp: no gradient


# ---------------------------------------------------------------- GSPO


def test_gspo_clips_the_geometric_mean_sequence_ratio():
    # row 0: token log-ratios [0.3, -0.3, 0.3], mean 0.1, s = e^0.1 = 1.10517; e^0.3 = 1.35 would be
    # clipped token by token at 1.2, the sequence ratio is not. row 1: [0, -0.2] and a masked token
    # with log-ratio 50 that must not count: mean -0.1, s = e^-0.1 = 0.904837.
    logp = [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]]
    lr = [[0.3, -0.3, 0.3], [0.0, -0.2, 50.0]]
    old = [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(logp, lr)]
    mask = [[1, 1, 1], [1, 1, 0]]
    s0, s1 = math.exp(0.1), math.exp(-0.1)
    x = inputs(logp, old_logp=old, adv=[[1.0] * 3, [-2.0] * 3], mask=mask)
    loss, m = GSPO(0.2, 0.2)(x)
    assert_close(loss, t([[-s0] * 3, [2 * s1] * 3]))
    assert_close(m["ratio_mean"], t([[s0] * 3, [s1] * 3]))
    assert m["clip_frac"].sum() == 0
    # s_i,t = sg(s_i) pi_t / sg(pi_t): d/dlogp_t = s_i, only through token t: grad = -A s_i
    assert_close(grad(loss, x), t([[-s0] * 3, [2 * s1, 2 * s1, 0.0]]))


def test_gspo_paper_bounds_clip_whole_sequences():
    logp = [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]]
    lr = [[0.3, -0.3, 0.3], [0.0, -0.2, 50.0]]
    old = [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(logp, lr)]
    mask = [[1, 1, 1], [1, 1, 0]]
    s1 = math.exp(-0.1)
    # (3e-4, 4e-4): row 0, A > 0, s = 1.105 > 1.0004: clipped, -A (1 + 4e-4), no gradient;
    # row 1, A > 0, s = 0.905 < 0.9997: the unclipped term -A s is the max, gradient -A s
    x = inputs(logp, old_logp=old, adv=[[1.0] * 3, [2.0] * 3], mask=mask)
    loss, m = GSPO()(x)
    assert_close(loss, t([[-1.0004] * 3, [-2 * s1] * 3]))
    assert m["clip_frac"].tolist() == [[1.0] * 3, [0.0] * 3]
    assert_close(grad(loss, x), t([[0.0] * 3, [-2 * s1, -2 * s1, 0.0]]))


# ---------------------------------------------------------------- CISPO, TIS, decoupled


def test_cispo_clipped_weight_is_held_constant_and_every_token_keeps_a_gradient():
    logp = [-1.0, -2.0, -0.5, -3.0]
    x = inputs(logp, ratio=[0.5, 1.0, 1.5, 0.1], adv=[1.0, -1.0, 1.0, -1.0])
    loss, m = CISPO()(x)  # low = 1 (clip at 0 only), high = 0.28
    w = [0.5, 1.0, 1.28, 0.1]
    assert_close(loss, t([-wi * a * lp for wi, a, lp in zip(w, [1, -1, 1, -1], logp)]))
    assert m["clip_frac"].tolist() == [0.0, 0.0, 1.0, 0.0]
    # -sg(clip(r)) A: r = 1.5 is clipped to 1.28, yet keeps a gradient
    assert_close(grad(loss, x), t([-0.5, 1.0, -1.28, 0.1]))
    x = inputs(logp, ratio=[0.5, 1.0, 1.5, 0.1], adv=[1.0, -1.0, 1.0, -1.0])
    loss, m = CISPO(0.2, 0.28)(x)
    assert_close(grad(loss, x), t([-0.8, 1.0, -1.28, 0.8]))
    assert m["clip_frac"].tolist() == [1.0, 0.0, 1.0, 1.0]


def test_tis_truncates_the_behaviour_ratio_and_ignores_the_proximal_policy():
    logp = [-1.0, -2.0, -0.5]
    behav = [lp - math.log(r) for lp, r in zip(logp, [0.5, 3.0, 1.0])]
    # the proximal policy is far off: TIS must not look at it
    x = inputs(logp, old_logp=[-30.0, 10.0, -5.0], rollout_logp=behav, adv=[2.0, -1.0, 1.0])
    loss, m = TIS(2.0)(x)
    w = [0.5, 2.0, 1.0]
    assert_close(loss, t([-wi * a * lp for wi, a, lp in zip(w, [2, -1, 1], logp)]))
    assert m["is_truncated_frac"].tolist() == [0.0, 1.0, 0.0]
    assert_close(m["clip_frac"], m["is_truncated_frac"])
    assert_close(m["ratio_mean"], t([0.5, 3.0, 1.0]))
    assert_close(m["is_weight_mean"], t(w))
    assert_close(grad(loss, x), t([-1.0, 2.0, -1.0]))  # -min(r, cap) A
    assert not TIS().needs_recompute


def test_decoupled_ppo_is_ppo_around_the_proximal_policy_times_the_behaviour_weight():
    # token 0: r = pi/pi_prox = 1.1 (unclipped), pi_prox/pi_behav = 3 -> weight 2;
    # token 1: r = 1.5 (clipped, A > 0), pi_prox/pi_behav = 0.5 -> weight 0.5
    logp = [-1.0, -2.0]
    old = [logp[0] - math.log(1.1), logp[1] - math.log(1.5)]
    behav = [old[0] - math.log(3.0), old[1] - math.log(0.5)]
    x = inputs(logp, old_logp=old, rollout_logp=behav, adv=[1.0, 1.0])
    loss, m = Decoupled(0.2, 0.2, is_cap=2.0)(x)
    assert_close(loss, t([-2.2, -0.6]))
    assert_close(m["pg_loss"], loss.detach())
    assert_close(m["is_weight_mean"], t([2.0, 0.5]))
    assert m["is_truncated_frac"].tolist() == [1.0, 0.0]
    assert m["clip_frac"].tolist() == [0.0, 1.0]
    assert_close(grad(loss, x), t([-2.2, 0.0]))
    assert Decoupled.needs_recompute and not PPOClip.needs_recompute
    assert not GSPO.needs_recompute and not CISPO.needs_recompute


# ---------------------------------------------------------------- mismatch corrections


def test_no_correction():
    c = NoCorrection()
    assert c(t([[0.0]]), t([[-50.0]]), t([[1.0]])) == (None, None, {})
    assert not c.needs_recompute


def test_token_tis_weights():
    rho = [[0.5, 1.0, 3.0]]
    behav = [[-math.log(r) for r in rho[0]]]
    weight, keep, m = TokenTIS(2.0)(t([[0.0, 0.0, 0.0]]), t(behav), t([[1, 1, 1]]))
    assert keep is None
    assert_close(weight, t([[0.5, 1.0, 2.0]]))
    assert_close(m["is_weight_mean"], weight)
    assert m["is_truncated_frac"].tolist() == [[0.0, 0.0, 1.0]]
    assert TokenTIS.needs_recompute


def test_seq_tis_weights_use_the_product_of_the_trained_tokens_ratios():
    # row 0: rho [0.5, 1.5] and a masked 50 -> 0.75; row 1: [2, 2, 1] -> 4, truncated to 2;
    # row 2: nothing trained -> ratio 1
    lr = [[math.log(0.5), math.log(1.5), 50.0], [math.log(2.0), math.log(2.0), 0.0], [7.0, 7.0, 7.0]]
    mask = t([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    weight, keep, m = SeqTIS(2.0)(t(lr), torch.zeros(3, 3), mask)
    assert keep is None
    assert_close(weight, t([[0.75] * 3, [2.0] * 3, [1.0] * 3]))
    assert_close(m["is_weight_mean"], t([0.75, 2.0, 1.0]))
    assert m["is_truncated_frac"].tolist() == [0.0, 1.0, 0.0]


def test_icepop_weights_by_rho_inside_the_band_and_masks_outside():
    rho = [0.4, 0.51, 1.0, 1.99, 2.5]
    keep_want = [0.0, 1.0, 1.0, 1.0, 0.0]
    lr = t([[math.log(r) for r in rho]])
    weight, keep, m = IcePop(0.5, 2.0)(lr, torch.zeros(1, 5), torch.ones(1, 5))
    assert keep.tolist() == [keep_want]
    assert_close(weight, t([[0.0, 0.51, 1.0, 1.99, 0.0]]))  # M(k) = k in [0.5, 2], else 0
    assert m["masked_token_frac"].tolist() == [[1 - k for k in keep_want]]
    # a log-ratio of +-50 is clamped, not inf/0, and masked
    weight, keep, _ = IcePop()(t([[50.0, -50.0]]), torch.zeros(1, 2), torch.ones(1, 2))
    assert keep.tolist() == [[0.0, 0.0]] and weight.tolist() == [[0.0, 0.0]]


@pytest.mark.parametrize("cls", ["IcePop", "SeqMask"])
def test_mask_band_is_checked(cls):
    check(f"rlexp.algorithms.mismatch.{cls}", low=0.0, high=1.5)
    for low, high in [(1.0, 2.0), (0.5, 1.0), (-0.1, 2.0)]:
        with pytest.raises(ConfigError):
            check(f"rlexp.algorithms.mismatch.{cls}", low=low, high=high)
    with pytest.raises(ConfigError):
        check("rlexp.algorithms.mismatch.TokenTIS", is_cap=0.5)


def test_seq_mask_geometric_and_product():
    # row 0: rho = e^0.6 on 3 tokens: geometric e^0.6 = 1.82 (kept), product e^1.8 = 6.05 (masked);
    # row 1: [-0.5, 0.3] and a masked 40: geometric e^-0.1 = 0.905, product e^-0.2 = 0.819 (kept);
    # row 2: [-1.0] alone: 0.368 either way (masked)
    lr = t([[0.6, 0.6, 0.6], [-0.5, 0.3, 40.0], [-1.0, 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    weight, keep, m = SeqMask(0.5, 2.0, geometric=True)(lr, torch.zeros(3, 3), mask)
    assert weight is None
    assert keep.tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3]
    assert m["masked_seq_frac"].tolist() == [0.0, 0.0, 1.0]
    assert m["masked_token_frac"].tolist() == [[0.0] * 3, [0.0] * 3, [1.0] * 3]
    _, keep, m = SeqMask(0.5, 2.0, geometric=False)(lr, torch.zeros(3, 3), mask)
    assert keep.tolist() == [[0.0] * 3, [1.0] * 3, [0.0] * 3]
    assert m["masked_seq_frac"].tolist() == [1.0, 0.0, 1.0]


def test_ratio_helpers():
    assert_close(clamped_exp(t([50.0, -50.0, 1.0])), t([math.exp(20), math.exp(-20), E]))
    lr, mask = t([[1.0, 2.0, 100.0], [5.0, 5.0, 5.0]]), t([[1, 1, 0], [0, 0, 0]])
    assert seq_log_ratio(lr, mask).tolist() == [3.0, 0.0]
    assert seq_log_ratio(lr, mask, mean=True).tolist() == [1.5, 0.0]


# ---------------------------------------------------------------- KL estimators


def kl_inputs():
    # log r = ref - logp = [0, 1, -1, 3]
    logp = t([-1.0, -2.0, -0.5, -4.0]).requires_grad_()
    ref = t([-1.0, -1.0, -1.5, -1.0])
    return logp, ref


@pytest.mark.parametrize("estimator,value,gradient", [
    ("k1", [0.0, -1.0, 1.0, -3.0], [1.0, 1.0, 1.0, 1.0]),  # -log r = logp - ref
    ("k2", [0.0, 0.5, 0.5, 4.5], [0.0, -1.0, 1.0, -3.0]),  # (log r)^2 / 2; d/dlogp = -log r
    ("k3", [0.0, E - 2, 1 / E, math.exp(3) - 4], [0.0, 1 - E, 1 - 1 / E, 1 - math.exp(3)]),  # 1 - r
    ("low_var_kl", [0.0, E - 2, 1 / E, 10.0], [0.0, 1 - E, 1 - 1 / E, 0.0]),  # min(k3, 10)
])
def test_kl_estimators(estimator, value, gradient):
    logp, ref = kl_inputs()
    kl = kl_estimate(logp, ref, estimator)
    assert_close(kl, t(value))
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert_close(g, t(gradient))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_are_finite_far_off(estimator):
    logp = t([-60.0, 0.0, -25.0, 0.0]).requires_grad_()
    ref = t([-10.0, -50.0, 0.0, -25.0])  # log r = [50, -50, 25, -25]
    kl = kl_estimate(logp, ref, estimator)
    (g,) = torch.autograd.grad(kl.sum(), logp)
    assert torch.isfinite(kl).all() and torch.isfinite(g).all()
    if estimator == "low_var_kl":
        assert (kl <= 10).all()


def test_kl_clamps_the_log_ratio_at_20():
    logp, ref = t([-60.0, 0.0]), t([-10.0, -50.0])  # log r = 50, -50
    assert_close(kl_estimate(logp, ref, "k3"), t([math.exp(20) - 20 - 1, math.exp(-20) + 20 - 1]))
    assert_close(kl_estimate(logp, ref, "k1"), t([-20.0, 20.0]))
    assert_close(kl_estimate(logp, ref, "k2"), t([200.0, 200.0]))
    assert kl_estimate(logp, ref, "low_var_kl").tolist() == [10.0, 10.0]


def test_kl_term_placement_and_token_rewards():
    assert not KLTerm("k3", 0.0).in_loss and not KLTerm("k3", 0.0).in_reward
    assert not KLTerm("k3", 0.0, "reward").in_reward
    assert KLTerm("k3", 0.1).in_loss and not KLTerm("k3", 0.1).in_reward
    assert KLTerm("k1", 0.1, "reward").in_reward and not KLTerm("k1", 0.1, "reward").in_loss
    logp, ref = kl_inputs()
    term = KLTerm("k2", 0.5, "reward")
    assert_close(term(logp, ref), t([0.0, 0.5, 0.5, 4.5]))
    mask = t([1, 1, 1, 0])
    # -coef * KL at trained tokens, 0 elsewhere
    assert_close(term.token_rewards(logp.detach(), ref, mask), t([0.0, -0.25, -0.25, 0.0]))
