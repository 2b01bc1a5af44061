"""The TrainController on the tiny model: token batches, logprobs, the update, checkpoints.
(The algorithm's formulas: test_algorithms*.py.)"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlexp.algorithms.mismatch import TIS, Decoupled
from rlexp.algorithms.objective import KLTerm, PPOClip
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.trainer.batch import Layout, TrainBatch
from rlexp.trainer.controller import TrainController
from tests.fakes import UNCHECKED


def test_micro_batches_cover_every_row_once_within_budget_longest_first():
    lengths = (5, 9, 3, 7, 2, 12)
    samples = [Sample(group_id=0, prompt=[], answer="",
                      trace=TokenTrace([1] * n, [1] * n, [0.0] * n, [0] * n)) for n in lengths]
    tb = TrainBatch.build(samples, 0, Layout(micro_batch_tokens=20))
    assert tb.input_ids.shape == (6, 12) and tb.loss_mask.shape == (6, 11)
    micro = tb.micro_batches
    assert sorted(i for mb in micro for i in mb.rows.tolist()) == list(range(6))
    for mb in micro:
        assert mb.width == max(lengths[i] for i in mb.rows.tolist())
        assert len(mb.rows) == 1 or len(mb.rows) * mb.width <= 20
    assert [mb.rows.tolist() for mb in micro] == [[5], [1, 3], [0, 2, 4]]  # 12 | 9+7 | 5+3+2
    only = tb.minibatches[0].micro_batches  # one minibatch on one rank: the same cut
    assert [m.rows.tolist() for m in only] == [m.rows.tolist() for m in micro]
    assert tb.pad_frac() == pytest.approx(1 - 38 / (12 + 18 + 15))


def _trainer(path, lr=1e-3, **kw):
    opt = lambda params: torch.optim.SGD(params, lr=lr)  # noqa: E731
    return TrainController(path, temperature=0.7, optimizer=opt, total_steps=1, sync_check=UNCHECKED, **kw)


def _batch(tokenizer, texts):
    from rlexp.chat.render import render_prompt

    out = []
    for gid, (q, responses) in enumerate(texts):
        prompt = render_prompt(tokenizer, [{"role": "user", "content": q}])
        for resp, reward in responses:
            r = tokenizer.encode(resp, add_special_tokens=False) + [tokenizer.eos_token_id]
            n = len(prompt) + len(r)
            trace = TokenTrace(prompt + r, [0] * len(prompt) + [1] * len(r), [0.0] * n)
            out.append(Sample(group_id=gid, prompt=[], answer="", trace=trace, reward=reward,
                              status=Status.COMPLETED))
    return out


@pytest.mark.parametrize("micro_batch_tokens", [4096, 40])  # one padded forward; several
def test_padded_logprobs_equal_one_sequence_at_a_time(tiny_model_path, tokenizer, micro_batch_tokens):
    batch = _batch(tokenizer, [("12+3=", [("15", 1.0), ("1", 0.0)]), ("7+7=", [("14", 1.0), ("99999", 0.0)])])
    trainer = _trainer(tiny_model_path, micro_batch_tokens=micro_batch_tokens, ref_kl_every_n_steps=0)
    packed = trainer.sample_logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    for s, lp in zip(batch, packed):
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens])).logits[0] / 0.7
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(s.tokens[1:])[:, None])[:, 0]
        assert torch.allclose(lp[1:], ref, atol=1e-5)


def test_grpo_step_moves_probability_toward_rewarded_answers(tiny_model_path, tokenizer):
    batch = _batch(tokenizer, [("12+3=", [("15", 1.0), ("99", 0.0), ("15", 1.0), ("99", 0.0)])])
    trainer = _trainer(tiny_model_path, lr=0.05, ref_kl_every_n_steps=1)
    before = trainer.sample_logprobs(batch)
    for s, lp in zip(batch, before):
        s.trace.logprobs = lp.tolist()  # on-policy: behaviour logprobs = current policy
    metrics = trainer.fit(batch, 0)
    after = trainer.sample_logprobs(batch)
    resp = lambda s, lp: (lp * torch.tensor(s.loss_mask)).sum().item()  # noqa: E731
    assert resp(batch[0], after[0]) > resp(batch[0], before[0]) + 1e-3  # rewarded: more likely
    assert resp(batch[1], after[1]) < resp(batch[1], before[1]) - 1e-3  # unrewarded: less likely
    assert metrics["train/mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["train/kl"] == pytest.approx(0.0, abs=1e-6)  # ref == policy before the step
    assert metrics["train/grad_norm"] > 0 and metrics["train/entropy"] > 0
    metrics = trainer.fit(batch, 1)  # second step: the policy has drifted from the reference
    assert metrics["train/kl"] > 0


def test_failed_samples_are_not_trained(tiny_model_path, tokenizer):
    batch = _batch(tokenizer, [("1+1=", [("2", 1.0), ("3", 0.0)])])
    batch[0].status = Status.FAILED
    trainer = _trainer(tiny_model_path, ref_kl_every_n_steps=0)
    metrics = trainer.fit(batch, 0)
    assert metrics["train/response_tokens"] == batch[1].response_length


def test_lr_schedules():
    from rlexp.trainer.schedule import lr_factor

    cos = lr_factor("cosine", warmup_steps=10, total_steps=110)
    assert cos(0) == pytest.approx(0.1) and cos(9) == pytest.approx(1.0)
    assert cos(10) == pytest.approx(1.0) and cos(60) == pytest.approx(0.55)
    assert cos(110) == pytest.approx(0.1) and cos(500) == pytest.approx(0.1)
    assert lr_factor("constant", 0, 100)(99) == 1.0


def test_failed_samples_without_tokens_do_not_break_logprobs(tiny_model_path, tokenizer):
    batch = _batch(tokenizer, [("1+1=", [("2", 1.0), ("3", 0.0)])])
    batch.append(Sample(group_id=0, prompt=[], answer="", status=Status.FAILED))  # no tokens at all
    trainer = _trainer(tiny_model_path, ref_kl_every_n_steps=1)
    lps = trainer.sample_logprobs(batch, reference=True)
    assert len(lps) == 3 and lps[2].numel() == 0 and lps[0].numel() == len(batch[0].tokens)
    trained = trainer.fit(batch, 0)["train/response_tokens"]
    assert trained == batch[0].response_length + batch[1].response_length


def test_no_signal_means_no_update(tiny_model_path, tokenizer):
    batch = _batch(tokenizer, [("1+1=", [("2", 1.0), ("2", 1.0)]), ("2+2=", [("5", 0.0), ("3", 0.0)])])
    trainer = TrainController(tiny_model_path, temperature=1.0, total_steps=2, ref_kl_every_n_steps=0,
                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), sync_check=UNCHECKED)
    batch[0].reward = 0.0  # first step has signal: Adam builds momentum
    trainer.fit(batch, 0)
    batch[0].reward = 1.0
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    metrics = trainer.fit(batch, 1)  # equal rewards within every group: nothing to learn
    assert metrics["train/skipped_step"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def _on_policy(trainer, batch, version):
    for s, lp in zip(batch, trainer.sample_logprobs(batch)):
        s.trace.logprobs = lp.tolist()
        s.trace.versions = [version] * len(s.tokens)
    return batch


@pytest.mark.parametrize("correction", ["decoupled", "tis"])
def test_off_policy_corrections_equal_plain_ppo_on_policy(tiny_model_path, tokenizer, correction):
    """On-policy every importance weight is 1, so one step moves the weights exactly as the
    uncorrected loss does; off-policy they differ (the correction does something)."""
    texts = [("12+3=", [("15", 1.0), ("99", 0.0), ("1", 0.0)])]
    steps = {}
    losses = {"none": PPOClip(), "decoupled": Decoupled(is_cap=10.0), "tis": TIS(is_cap=10.0)}
    for mode in ("none", correction):
        trainer = _trainer(tiny_model_path, lr=0.05, ref_kl_every_n_steps=0, policy_loss=losses[mode])
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.fit(_on_policy(trainer, _batch(tokenizer, texts), version=0), 0)
        steps[mode] = {k: v - before[k] for k, v in trainer.model.state_dict().items()}
    assert any(d.abs().max() > 1e-4 for d in steps["none"].values())
    for k, d in steps["none"].items():
        assert torch.allclose(d, steps[correction][k], atol=1e-6), k


def test_importance_weights_are_truncated_and_broken_down_by_staleness(tiny_model_path, tokenizer):
    texts = [("12+3=", [("15", 1.0), ("99", 0.0)]), ("7+7=", [("14", 1.0), ("1", 0.0)])]
    for loss in (Decoupled(is_cap=2.0), TIS(is_cap=2.0)):
        trainer = _trainer(tiny_model_path, ref_kl_every_n_steps=0, policy_loss=loss)
        batch = _on_policy(trainer, _batch(tokenizer, texts), version=4)
        for s in batch[2:]:  # the second group is one version old, its behaviour policy less sure
            s.trace.logprobs = [lp - 1.0 if m else lp for lp, m in zip(s.logprobs, s.loss_mask)]
            s.trace.versions = [3] * len(s.tokens)
        m = trainer.fit(batch, 4)
        stale_tokens = sum(s.response_length for s in batch[2:])
        assert m["offpolicy/tokens/staleness_1"] == stale_tokens
        assert m["offpolicy/tokens/staleness_0"] == sum(s.response_length for s in batch[:2])
        assert m["offpolicy/ratio_mean/staleness_0"] == pytest.approx(1.0, abs=1e-4)
        assert m["offpolicy/ratio_mean/staleness_1"] == pytest.approx(torch.e, rel=1e-3)
        assert m["offpolicy/mismatch_kl/staleness_1"] == pytest.approx(math.exp(-1), rel=1e-3)  # k3
        # pi/pi_behav = e on the stale tokens, capped at 2; 1 elsewhere
        n = sum(s.response_length for s in batch)
        assert m["train/is_weight_max"] == pytest.approx(2.0, rel=1e-4)
        assert m["train/is_weight_mean"] == pytest.approx((n + stale_tokens) / n, rel=1e-3)
        assert m["train/is_truncated_frac"] == pytest.approx(stale_tokens / n, rel=1e-3)


def test_save_then_load_continues_exactly(tiny_model_path, tokenizer, tmp_path):
    """The trainer owns its checkpoint: a fresh trainer loaded from `save` takes the same
    next step (weights, AdamW moments and lr schedule all restored)."""
    texts = [("12+3=", [("15", 1.0), ("99", 0.0)]), ("7+7=", [("14", 1.0), ("1", 0.0)])]

    def make():
        return TrainController(tiny_model_path, temperature=1.0, total_steps=10, ref_kl_every_n_steps=0,
                               lr_schedule="cosine", warmup_steps=3,
                               optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), sync_check=UNCHECKED)

    a = make()
    a.fit(_batch(tokenizer, texts), 0)
    a.save(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"model.safetensors", "trainer.pt"}
    b = make()
    b.load(tmp_path)
    ma, mb = a.fit(_batch(tokenizer, texts), 1), b.fit(_batch(tokenizer, texts), 1)
    assert ma["train/lr"] == mb["train/lr"] != make().learner.optimizer.param_groups[0]["lr"]
    wa, wb = dict(a.weights()), dict(b.weights())
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], v) for k, v in make().weights())  # the steps moved them


def test_reference_forward_runs_only_on_the_steps_that_log_kl(tiny_model_path, tokenizer):
    texts = [("12+3=", [("15", 1.0), ("99", 0.0)])]
    trainer = _trainer(tiny_model_path, lr=0.05, ref_kl_every_n_steps=3)
    calls = []
    ref = trainer.learner.policy.reference.model
    forward = ref.forward
    ref.forward = lambda *a, **kw: calls.append(1) or forward(*a, **kw)
    logged = ["train/kl" in trainer.fit(_batch(tokenizer, texts), v) for v in range(6)]
    assert logged == [False, False, True, False, False, True] and len(calls) == 2
    assert not _trainer(tiny_model_path, ref_kl_every_n_steps=0).learner.policy.reference  # unused: not kept
    with_loss = _trainer(tiny_model_path, lr=0.05, ref_kl_every_n_steps=0, kl=KLTerm(coef=0.1))
    assert all("train/kl" in with_loss.fit(_batch(tokenizer, texts), v) for v in range(2))
