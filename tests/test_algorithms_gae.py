"""GAE and the clipped value loss on hand-computed values and gradients."""

import pytest
import torch

from rlexp.algorithms.advantages import AdvantageInputs, whiten
from rlexp.algorithms.gae import GAE, ClippedValueLoss, gae, outcome_on_last_step

T = torch.tensor


def _gae(rewards, values, mask, gamma, lam):
    return gae(T([rewards]), T([values]), T([mask]), gamma, lam)


@pytest.mark.parametrize("gamma,lam,adv,ret", [
    # lam = 1: Monte Carlo, the discounted return minus V; every return is the outcome 1
    (1.0, 1.0, [0.5, 0.4, 0.3], [1.0, 1.0, 1.0]),
    # lam = 0: the one-step TD error r_t + V_t+1 - V_t; returns r_t + V_t+1
    (1.0, 0.0, [0.1, 0.1, 0.3], [0.6, 0.7, 1.0]),
    # gamma 0.9, lam 0.5: A2 = 1 - .7; A1 = (.9*.7 - .6) + .45*A2; A0 = (.9*.6 - .5) + .45*A1
    (0.9, 0.5, [0.04 + 0.45 * 0.165, 0.165, 0.3], [0.5 + 0.04 + 0.45 * 0.165, 0.765, 1.0]),
])
def test_gae_hand_computed(gamma, lam, adv, ret):
    a, r = _gae([0, 0, 1], [0.5, 0.6, 0.7], [1, 1, 1], gamma, lam)
    assert a[0].tolist() == pytest.approx(adv, abs=1e-6)
    assert r[0].tolist() == pytest.approx(ret, abs=1e-6)


def test_gae_passes_over_tokens_the_policy_did_not_write():
    """Turn 1 (position 0), a 2-token tool reply (1, 2, values never read), turn 2 (3): the
    tool tokens are not steps, so turn 1 sees turn 2 as its next step, one discount away."""
    a, r = _gae([0, 5, 5, 1], [0.5, 9.0, 9.0, 0.7], [1, 0, 0, 1], 0.9, 1.0)
    assert a[0].tolist() == pytest.approx([0.9 * 1 - 0.5, 0, 0, 0.3], abs=1e-6)
    assert r[0].tolist() == pytest.approx([0.9, 0, 0, 1.0], abs=1e-6)
    # the prompt before the first step and padding after the last are not steps either
    a, _ = _gae([0, 0, 1, 0], [3.0, 0.5, 0.7, 3.0], [0, 1, 1, 0], 1.0, 1.0)
    assert a[0].tolist() == pytest.approx([0, 0.5, 0.3, 0], abs=1e-6)


def test_outcome_reward_goes_on_each_completed_samples_last_step():
    x = AdvantageInputs(rewards=T([2.0, 3.0, 4.0, 5.0]), groups=[0, 0, 1, 1],
                        completed=T([True, True, True, False]),
                        mask=T([[1, 1, 0], [0, 1, 1], [0, 0, 0], [1, 1, 1]]).float(),
                        token_rewards=T([[-0.1, -0.2, -9.0], [0, 0, 0], [0, 0, 0], [1, 1, 1]]).float())
    want = [[-0.1, 1.8, 0], [0, 0, 3.0], [0, 0, 0], [0, 0, 0]]  # off-mask and failed: nothing
    assert torch.allclose(outcome_on_last_step(x), T(want))


def test_gae_estimator_whitens_advantages_and_keeps_raw_returns():
    mask = T([[1, 1, 1], [1, 1, 0], [1, 1, 1]]).float()
    values = T([[0.1, 0.2, 0.3], [0.0, -0.5, 7.0], [0.4, 0.4, 0.4]])
    x = AdvantageInputs(rewards=T([1.0, 0.0, 1.0]), groups=[0, 1, 2],
                        completed=T([True, True, False]), mask=mask, values=values)
    adv, ret = GAE(gamma=1.0, lam=1.0).advantages_and_returns(x)
    steps = mask * T([[1.0], [1.0], [0.0]])
    raw = T([[0.9, 0.8, 0.7], [0.0, 0.5, 0.0], [0, 0, 0]])
    assert torch.allclose(ret, T([[1.0, 1, 1], [0, 0, 0], [0, 0, 0]]), atol=1e-6)
    assert torch.allclose(adv, whiten(raw, steps), atol=1e-6)
    assert adv[2].abs().sum() == 0  # failed: 0 and no part in the whitening
    assert torch.allclose(GAE(lam=1.0, whiten=False)(x), raw, atol=1e-6)


def test_gae_needs_values_and_valid_parameters():
    x = AdvantageInputs(rewards=T([1.0]), groups=[0], completed=T([True]), mask=T([[1.0]]))
    with pytest.raises(ValueError, match="critic"):
        GAE()(x)
    with pytest.raises(ValueError, match="lam"):
        GAE(lam=1.5)


def test_clipped_value_loss_values_gradients_and_clip_frac():
    """Row 0: V moved away from R beyond the clip: the unclipped error is larger and keeps its
    gradient V - R. Row 1: V moved toward R beyond the clip: the clipped error (from
    V_old - 0.2) is larger and carries no gradient. Row 2: inside the clip: the plain error."""
    v = T([1.0, 0.6, 0.45], requires_grad=True)
    old, ret = T([0.5, 1.0, 0.5]), T([0.0, 0.0, 0.0])
    loss, m = ClippedValueLoss(clip=0.2)(v, old, ret)
    assert loss.tolist() == pytest.approx([0.5, 0.5 * 0.8 ** 2, 0.5 * 0.45 ** 2])
    loss.sum().backward()
    assert v.grad.tolist() == pytest.approx([1.0, 0.0, 0.45])
    assert m["vf_clip_frac"].tolist() == [0.0, 1.0, 0.0]
    plain, _ = ClippedValueLoss(clip=None)(v.detach(), old, ret)
    assert plain.tolist() == pytest.approx([0.5, 0.18, 0.10125])
