"""rlexp.algorithms.advantages: the group estimators (GRPO, Dr.GRPO, RLOO) and REINFORCE++ (plain
and with a group baseline), against the papers' formulas on small hand-made inputs: the group
statistics, failed samples, token rewards, whitening. (Aggregations and the composed Objective:
test_algorithms.py.)"""

import math

import pytest
import torch
from torch.testing import assert_close

from rlexp.algorithms.advantages import GroupNormalized, LeaveOneOut, ReinforcePP, ReinforcePPBaseline, whiten
from tests.algorithm_helpers import adv_inputs, t

EPS = 1e-6  # GroupNormalized's default


def per_sample(adv: torch.Tensor) -> torch.Tensor:
    """The group estimators give every token of a sample the same advantage."""
    assert adv.dim() == 2 and torch.equal(adv, adv[:, :1].expand_as(adv))
    return adv[:, 0]


# ---------------------------------------------------------------- GRPO / Dr.GRPO


def test_grpo_population_std():
    adv = GroupNormalized()(adv_inputs([1, 0, 0, 1]))
    assert adv.shape == (4, 2)
    # mean 0.5, population std 0.5
    assert_close(per_sample(adv), t([1, -1, -1, 1]) * 0.5 / (0.5 + EPS))


def test_grpo_sample_std_uses_bessel():
    adv = GroupNormalized("sample")(adv_inputs([1, 0, 0, 1]))
    # sample std sqrt((4 * 0.25) / 3) = 0.57735: 0.5 / 0.57735 = 0.866
    assert_close(per_sample(adv), t([1, -1, -1, 1]) * 0.5 / (math.sqrt(1 / 3) + EPS))


def test_dr_grpo_only_centers():
    assert_close(per_sample(GroupNormalized("none")(adv_inputs([1, 0, 0, 1]))), t([0.5, -0.5, -0.5, 0.5]))
    assert_close(per_sample(GroupNormalized("none")(adv_inputs([3, 1, 2]))), t([1.0, -1.0, 0.0]))


def test_grpo_groups_are_normalised_separately():
    # group a = [1, 0, 1]: mean 2/3, population std sqrt(2/9); group b = [5, 3]: mean 4, std 1
    x = adv_inputs([1, 5, 0, 1, 3], groups=["a", "b", "a", "a", "b"])
    sa = math.sqrt(2 / 9) + EPS
    want = [(1 / 3) / sa, 1 / (1 + EPS), (-2 / 3) / sa, (1 / 3) / sa, -1 / (1 + EPS)]
    assert_close(per_sample(GroupNormalized()(x)), t(want))


@pytest.mark.parametrize("estimator", [GroupNormalized("population"), GroupNormalized("sample"),
                                       GroupNormalized("none"), LeaveOneOut()])
def test_one_sample_and_zero_variance_groups_get_zero(estimator):
    x = adv_inputs([0.7, 1, 1, 1, -2, -2], groups=[0, 1, 1, 1, 2, 2])
    assert torch.equal(estimator(x), torch.zeros(6, 2))


@pytest.mark.parametrize("estimator,want", [
    (GroupNormalized("population"), [0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS)]),
    (GroupNormalized("sample"), [0.5 / (math.sqrt(1 / 3) + EPS), -0.5 / (math.sqrt(1 / 3) + EPS)]),
    (GroupNormalized("none"), [0.5, -0.5]),
    (LeaveOneOut(), [2 / 3, -2 / 3]),  # r_i - mean of the 3 others: 1 - 1/3, 0 - 2/3
])
def test_failed_samples_get_zero_and_do_not_shift_their_group(estimator, want):
    # the failed sample's reward (5) must not enter the group [1, 0, 0, 1]; a group whose only
    # sample failed gets 0 too
    x = adv_inputs([1, 0, 5, 0, 1, 9], groups=["g"] * 5 + ["h"], completed=[1, 1, 0, 1, 1, 0])
    hi, lo = want
    assert_close(per_sample(estimator(x)), t([hi, lo, 0.0, lo, hi, 0.0]))


def test_group_scores_include_masked_token_rewards():
    # scores: 1 + (-0.2 - 0.3) = 0.5 (the masked -9 does not count), 0 + 0.1 = 0.1
    x = adv_inputs([1, 0], mask=[[1, 1, 0], [1, 1, 1]], token_rewards=[[-0.2, -0.3, -9.0], [0.1, 0.0, 0.0]])
    assert_close(x.scores(), t([0.5, 0.1]))
    assert_close(per_sample(GroupNormalized("none")(x)), t([0.2, -0.2]))
    assert_close(per_sample(GroupNormalized()(x)), t([1, -1]) * 0.2 / (0.2 + EPS))


# ---------------------------------------------------------------- RLOO


def test_rloo_leave_one_out_baseline():
    # [1, 0, 0]: 1 - 0, 0 - (1 + 0)/2, ... = [1, -0.5, -0.5]; mean-centering would give [2/3, -1/3, -1/3]
    x = adv_inputs([1, 0, 0, 1, 4], groups=[0, 0, 0, 1, 2], completed=[1, 1, 1, 0, 1])
    assert_close(per_sample(LeaveOneOut()(x)), t([1.0, -0.5, -0.5, 0.0, 0.0]))
    assert_close(per_sample(LeaveOneOut()(adv_inputs([1, 0, 0, 1]))), t([2 / 3, -2 / 3, -2 / 3, 2 / 3]))


# ---------------------------------------------------------------- REINFORCE++


def test_whiten_uses_bessel_and_needs_two_entries():
    # [1, 1, 0]: mean 2/3, var (2/9 + 4/9) / 2 = 1/3 (population: 2/9)
    s = math.sqrt(1 / 3 + 1e-8)
    want = t([[1 / 3 / s, 1 / 3 / s], [-2 / 3 / s, 0]])
    assert_close(whiten(t([[1, 1], [0, 7]]), t([[1, 1], [1, 0]])), want)
    assert torch.equal(whiten(t([[3.0, 4.0]]), t([[1, 0]])), torch.zeros(1, 2))


def test_reinforce_pp_whitens_outcome_returns_over_the_batch():
    # tokens [1, 1 | 0]: as in the whitening test; a failed sample (reward 10, full mask) gets 0
    # and is not counted in the statistics
    s = math.sqrt(1 / 3 + 1e-8)
    x = adv_inputs([1, 0, 10], groups=[0, 1, 0], completed=[1, 1, 0], mask=[[1, 1], [1, 0], [1, 1]])
    assert_close(ReinforcePP()(x), t([[1 / 3 / s, 1 / 3 / s], [-2 / 3 / s, 0.0], [0.0, 0.0]]))


def test_reinforce_pp_per_token_returns_sum_rewards_to_go():
    # G_t = r + sum_{t' >= t} r_t' over trained tokens:
    # row 0: 1 + [-0.6, -0.5, -0.3] = [0.4, 0.5, 0.7]; row 1: 0 + [-0.5, 0.0] (the masked -9 is not a reward)
    # mean 1.1/5 = 0.22, deviations [0.18, 0.28, 0.48, -0.72, -0.22], Bessel var 0.908 / 4
    x = adv_inputs([1, 0], mask=[[1, 1, 1], [1, 1, 0]], token_rewards=[[-0.1, -0.2, -0.3], [-0.5, 0.0, -9.0]])
    s = math.sqrt(0.908 / 4 + 1e-8)
    want = t([[0.18, 0.28, 0.48], [-0.72, -0.22, 0.0]]) / s
    assert_close(ReinforcePP()(x), want)


def test_reinforce_pp_baseline_subtracts_the_group_mean_before_whitening():
    # g1 [1, 0] -> [0.5, -0.5], g2 [1, 1] -> [0, 0]; tokens [0.5, 0.5 | -0.5 | 0 | 0]: mean 0.1,
    # deviations [0.4, 0.4, -0.6, -0.1, -0.1], Bessel var 0.7 / 4. The failed sample (7) is left out.
    # (Without the baseline the tokens would be [1, 1, 0, 1, 1].)
    x = adv_inputs([1, 0, 1, 1, 7], groups=[1, 1, 2, 2, 1], completed=[1, 1, 1, 1, 0],
                   mask=[[1, 1], [1, 0], [1, 0], [1, 0], [1, 1]])
    s = math.sqrt(0.7 / 4 + 1e-8)
    want = t([[0.4, 0.4], [-0.6, 0.0], [-0.1, 0.0], [-0.1, 0.0], [0.0, 0.0]]) / s
    assert_close(ReinforcePPBaseline()(x), want)


@pytest.mark.parametrize("estimator", [ReinforcePP(), ReinforcePPBaseline()], ids=["plain", "baseline"])
def test_reinforce_pp_baseline_keeps_per_token_returns(estimator):
    # One group: its baseline (the group mean, of rewards or of scores) is a constant shift of
    # every return, which the whitening removes, so REINFORCE++-baseline must give REINFORCE++'s
    # per-token advantages (the returns-to-go G_t = r + sum_{t' >= t} r_t', as in OpenRLHF's
    # reinforce_baseline: rewards - group mean, then cumulative returns, then whitening).
    x = adv_inputs([1, 0], mask=[[1, 1, 1], [1, 1, 0]], token_rewards=[[-0.1, -0.2, -0.3], [-0.5, 0.0, -9.0]])
    s = math.sqrt(0.908 / 4 + 1e-8)
    want = t([[0.18, 0.28, 0.48], [-0.72, -0.22, 0.0]]) / s
    assert_close(estimator(x), want)
