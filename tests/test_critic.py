"""PPO's critic in the TrainController on the tiny model: values, the critic-only warm-up,
checkpoints, exact micro-batching, and what never reaches the engine."""

import functools

import pytest
import torch
from safetensors.torch import load_file

from rlexp.algorithms.advantages import GroupNormalized
from rlexp.algorithms.gae import GAE
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.trainer.controller import TrainController
from rlexp.trainer.critic import CRITIC_FILE, Critic
from rlexp.trainer.fit_metrics import explained_variance
from rlexp.weights.files import WEIGHTS_FILE
from tests.fakes import UNCHECKED


def _adamw(lr):
    # eps 1e-6 as tests/dist_fit.py: Adam's g / sqrt(v) turns float-error-sized gradients into lr-sized steps
    return functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.0, eps=1e-6)


def _ppo(path, critic_only_steps=0, micro_batch_tokens=8192, **kw):
    torch.manual_seed(0)  # the value head's initial weights
    critic = functools.partial(Critic, optimizer=_adamw(1e-3), critic_only_steps=critic_only_steps)
    return TrainController(path, temperature=1.0, optimizer=_adamw(1e-3), total_steps=4,
                           advantage=GAE(lam=0.9), critic=critic, old_logprobs="recompute",
                           ref_kl_every_n_steps=0, micro_batch_tokens=micro_batch_tokens,
                           sync_check=UNCHECKED, **kw)


def _batch(seed=0, n=8):
    """Two prompts x 4 samples of random tokens: prompt 5, response 3-8, reward 1 or 0; one
    sample has a 3-token tool reply (loss mask 0) between two turns."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        resp = int(torch.randint(3, 9, (1,), generator=g))
        tokens = torch.randint(10, 120, (5 + resp,), generator=g).tolist()
        mask = [0] * 5 + [1] * resp
        if i == 3:
            mask[6:9] = [0, 0, 0]
        out.append(Sample(group_id=i // 4, prompt=[], answer="", reward=float(i % 2),
                          trace=TokenTrace(tokens, mask, [0.0] * len(tokens)), status=Status.COMPLETED))
    return out


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_ppo_fit_trains_policy_and_critic_and_logs_the_critic(tiny_model_path):
    t = _ppo(tiny_model_path)
    policy0, critic0 = _state(t.model), _state(t.critic.model)
    m = t.fit(_batch(), version=0)
    assert _max_diff(policy0, _state(t.model)) > 0 and _max_diff(critic0, _state(t.critic.model)) > 0
    for key in ("critic/vf_loss", "critic/vf_clip_frac", "critic/value_mean", "critic/returns_mean",
                "critic/explained_var", "critic/grad_norm", "critic/lr", "train/pg_loss"):
        assert key in m and m[key] == m[key], key
    assert m["critic/lr"] == pytest.approx(1e-3) and m["critic/grad_norm"] > 0
    # only the policy is published: the engine gets a causal LM's tensors, no value head
    names = [n for n, _ in t.weights()]
    assert names == list(t.model.state_dict()) and not any("score" in n for n in names)


def test_critic_only_steps_hold_the_policy(tiny_model_path):
    t = _ppo(tiny_model_path, critic_only_steps=1)
    policy0, critic0 = _state(t.model), _state(t.critic.model)
    m = t.fit(_batch(), version=0)
    assert _max_diff(policy0, _state(t.model)) == 0 and _max_diff(critic0, _state(t.critic.model)) > 0
    assert m["train/skipped_step"] == 1.0
    t.fit(_batch(1), version=1)
    assert _max_diff(policy0, _state(t.model)) > 0


def test_value_loss_is_exact_over_micro_batches(tiny_model_path):
    """One forward for the whole batch vs micro-batches of 24 tokens: the same critic and
    policy after 2 fits (the value loss divides by the minibatch's totals, like the policy's)."""
    runs = []
    for tokens in (100000, 24):
        t = _ppo(tiny_model_path, micro_batch_tokens=tokens, minibatches_per_step=2)
        for step in range(2):
            t.fit(_batch(step), version=step)
        runs.append((_state(t.model), _state(t.critic.model)))
    assert _max_diff(runs[0][0], runs[1][0]) < 1e-5
    assert _max_diff(runs[0][1], runs[1][1]) < 1e-5


def test_checkpoint_restores_the_critic_and_its_optimizer(tiny_model_path, tmp_path):
    """fit, save, fit == fit, save, load into a fresh controller, fit: same numbers."""
    a = _ppo(tiny_model_path)
    a.fit(_batch(0), version=0)
    a.save(tmp_path)
    assert set(load_file(str(tmp_path / CRITIC_FILE))) == set(a.critic.model.state_dict())
    assert not any("score" in k for k in load_file(str(tmp_path / WEIGHTS_FILE)))
    b = _ppo(tiny_model_path)
    b.load(tmp_path)
    ma, mb = a.fit(_batch(1), version=1), b.fit(_batch(1), version=1)
    assert _max_diff(_state(a.critic.model), _state(b.critic.model)) == 0
    assert _max_diff(_state(a.model), _state(b.model)) == 0
    assert ma["critic/vf_loss"] == mb["critic/vf_loss"] and ma["critic/lr"] == mb["critic/lr"]


def test_gae_and_critic_go_together(tiny_model_path):
    with pytest.raises(ValueError, match="needs a critic"):
        TrainController(tiny_model_path, temperature=1.0, optimizer=_adamw(1e-3), total_steps=1,
                        advantage=GAE())
    with pytest.raises(ValueError, match="needs a critic"):
        TrainController(tiny_model_path, temperature=1.0, optimizer=_adamw(1e-3), total_steps=1,
                        advantage=GroupNormalized(), critic=functools.partial(Critic, optimizer=_adamw(1e-3)))


def test_explained_variance():
    mask = torch.tensor([[1.0, 1, 1, 0]])
    ret = torch.tensor([[1.0, 2, 3, 99]])
    assert explained_variance(ret, ret, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 2.0), ret, mask) == pytest.approx(0.0)
    # V = R + (1, -1, 1): Var(R - V) = 4/3 (Bessel), Var(R) = 1
    assert explained_variance(ret + torch.tensor([[1.0, -1, 1, 0]]), ret, mask) == pytest.approx(1 - 4 / 3)


def _own_loop_fit(learner, samples, version):
    """The update's stages called one by one, as a loop of one's own would (rlexp/trainer/update.py)."""
    from rlexp.trainer import update
    from rlexp.trainer.batch import TrainBatch, trained

    batch = TrainBatch.build(trained(samples), version, learner.layout, produced=len(samples))
    old = update.old_logprobs(learner, batch)
    ref = update.ref_logprobs(learner, batch)
    values = update.critic_values(learner, batch)
    signals = update.advantages(learner, batch, old, ref, values)
    assert signals.advantages.shape == batch.loss_mask.shape and signals.returns is not None
    for minibatch in batch.minibatches:
        update.forward_backward(learner, batch, minibatch, signals)
        update.optimizer_step(learner)
        update.critic_step(learner, batch, minibatch, signals)
    update.end_of_fit(learner, {})


def test_the_stages_called_one_by_one_make_fit(tiny_model_path):
    """A loop of one's own calling the update's stages (the low-level API) and `fit`: the same
    weights (policy and critic) after 5 steps, with every stage doing work (a recomputed
    proximal policy, the reference for the KL in the reward, the critic, two minibatches);
    `fit` times each stage."""
    from rlexp.algorithms.objective import KLTerm

    kw = dict(kl=KLTerm("k1", coef=0.05, where="reward"), minibatches_per_step=2)
    by_fit, by_stages = _ppo(tiny_model_path, **kw), _ppo(tiny_model_path, **kw)
    for step in range(5):
        batch = _batch(seed=step)
        m_fit = by_fit.fit(batch, step)
        _own_loop_fit(by_stages.learner, batch, step)
        stages = ("prepare", "old_logprobs", "ref_logprobs", "values", "advantages", "train")
        assert {k for k in m_fit if k.startswith("timing/fit/")} == {f"timing/fit/{c}_s" for c in stages}
    assert m_fit["train/kl"] != 0 and m_fit["critic/vf_loss"] > 0 and m_fit["train/skipped_step"] == 0
    for a, b in ((by_fit.model, by_stages.model), (by_fit.critic.model, by_stages.critic.model)):
        sa, sb = _state(a), _state(b)
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert by_fit.learner.fits_done == by_stages.learner.fits_done == 5
