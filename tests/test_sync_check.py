"""The in-run sync check (rlexp/trainer/sync_check.py) on hand-made figures and on the tiny
model's trainer: what it measures, when it stops, and that it stops before the optimizer step.
The planted faults against a real engine are in the engine modules (test_engines.py,
test_lora_engine.py, test_moe.py); a whole run that stops: test_run_stops.py."""

from functools import partial

import pytest
import torch

from rlexp.algorithms.kl import kl_estimate
from rlexp.errors import SyncMismatch
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.trainer.controller import TrainController
from rlexp.trainer.sync_check import AUTO_BOUNDS, SyncCheck, resolve_bound


def test_the_figures_count_only_trained_tokens_generated_at_the_current_version():
    check = SyncCheck(bound="off")
    logp = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-1.0, -1.0, -1.0, -1.0]])
    engine = torch.tensor([[-1.5, -2.0, -3.25, -9.0], [-1.0, -1.1, -5.0, -1.0]])
    staleness = torch.tensor([[0, 0, 0, 1], [0, 0, 2, 0]])  # 9.0 and 5.0 are stale: not counted
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # the row-1 token 0 is a prompt token
    check.add(logp, engine, staleness, mask)
    out = check.finish(version=3)
    # counted |diffs|: 0.5, 0, 0.25 (row 0) and 0.1, 0 (row 1)
    assert out["sync/tokens"] == 5
    assert out["sync/logprob_diff_max"] == pytest.approx(0.5)
    assert out["sync/logprob_diff_mean"] == pytest.approx(0.85 / 5)
    expected_p99 = torch.quantile(torch.tensor([0.0, 0.0, 0.1, 0.25, 0.5]), 0.99).item()
    assert out["sync/logprob_diff_p99"] == pytest.approx(expected_p99)


@pytest.mark.parametrize("n, counted", [(1, 1.0), (7, 0.5), (5000, 0.3)])
def test_p99_is_torch_quantile_of_the_counted_tokens(n, counted):
    g = torch.Generator().manual_seed(n)
    logp, engine = torch.randn(1, n, generator=g), torch.randn(1, n, generator=g)
    mask = (torch.rand(1, n, generator=g) < counted).float()
    mask[0, 0] = 1.0
    check = SyncCheck(bound="off")
    check.add(logp, engine, torch.zeros(1, n, dtype=torch.long), mask)
    out = check.finish(0)
    d = (logp - engine).abs()[mask.bool()]
    assert out["sync/tokens"] == d.numel()
    assert out["sync/logprob_diff_p99"] == pytest.approx(torch.quantile(d, 0.99).item(), rel=1e-6)
    assert out["sync/logprob_diff_max"] == d.max().item()
    assert out["sync/logprob_diff_mean"] == pytest.approx(d.mean().item(), rel=1e-5)


def test_past_the_bound_it_names_the_version_the_size_and_the_causes():
    check = SyncCheck(bound=0.01)
    ones = torch.ones(1, 200)
    check.add(-ones, -ones - 0.02, 0 * ones, ones)
    with pytest.raises(SyncMismatch, match=r"policy version 7 did not land.*200 tokens.*p99 0\.02.*"
                                           r"bound 0\.01.*tied lm_head.*LoRA"):
        check.finish(version=7)
    check.add(-ones, -ones - 0.005, 0 * ones, ones)  # under it: the figures, no error
    assert check.finish(7)["sync/logprob_diff_p99"] == pytest.approx(0.005, rel=1e-4)


def test_a_few_outlying_tokens_pass_the_p99_bound_but_not_a_shifted_batch():
    """bf16 noise: a handful of near-tied tokens differ far more than the rest."""
    check = SyncCheck(bound=0.1)
    logp = torch.zeros(1, 1000)
    engine = torch.zeros(1, 1000)
    engine[0, :5] = 2.0  # 0.5% of tokens
    check.add(logp, engine, 0 * logp, 1 + 0 * logp)
    assert check.finish(1)["sync/logprob_diff_max"] == 2.0
    check.add(logp, engine + 0.2, 0 * logp, 1 + 0 * logp)
    with pytest.raises(SyncMismatch):
        check.finish(1)


def test_bounds_by_dtype_the_looser_of_engine_and_trainer():
    assert resolve_bound("auto", ["float32", "float32"]) == AUTO_BOUNDS["float32"]
    assert resolve_bound("auto", ["float32", "bfloat16"]) == AUTO_BOUNDS["bfloat16"]
    assert resolve_bound("off", ["float32"]) is None
    assert resolve_bound(False, ["float32"]) is None  # `bound=off` as YAML reads it
    assert resolve_bound(0.0, ["float32"]) == 0.0
    assert resolve_bound(0.5, ["float32"]) == 0.5
    assert SyncCheck(engine_dtype="bfloat16").bound == AUTO_BOUNDS["bfloat16"]


def test_k3_is_not_negative_near_zero():
    """exp(x) - x - 1 in float32 cancels (its error is ~1e-7, x^2 / 2 is ~1e-10 here: logged
    values came out negative); expm1(x) - x is >= 0 and within float32 rounding of x."""
    x = torch.linspace(-3e-5, 3e-5, 1000)
    k3 = kl_estimate(torch.zeros(1000), x, "k3")  # log r = x exactly
    assert (k3 >= 0).all()
    assert ((k3 - x.double() ** 2 / 2).abs() <= 2 * torch.finfo(torch.float32).eps * x.abs()).all()


def _batch(trainer, tokenizer, shift=0.0, version=0):
    """Samples generated at `version` whose engine logprobs are the trainer's own, + `shift`."""
    out = []
    for gid, (q, a) in enumerate([("12+3=", "15"), ("12+3=", "1"), ("7+7=", "14"), ("7+7=", "99")]):
        prompt = tokenizer.encode(q, add_special_tokens=False)
        resp = tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id]
        n = len(prompt) + len(resp)
        trace = TokenTrace(prompt + resp, [0] * len(prompt) + [1] * len(resp), [0.0] * n, [version] * n)
        out.append(Sample(group_id=gid // 2, prompt=[], answer="", trace=trace, reward=float(gid % 2 == 0),
                          status=Status.COMPLETED))
    for s, lp in zip(out, trainer.sample_logprobs(out)):
        s.trace.logprobs = [v + shift * m for v, m in zip(lp.tolist(), s.loss_mask)]
    return out


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])  # the first forward: train's or its own
def test_a_fit_on_logprobs_it_does_not_give_stops_before_the_optimizer_step(tiny_model_path, tokenizer,
                                                                             old_logprobs):
    """The trainer's own logprobs pass (and count every response token); shifted by 0.01 they
    stop the fit with no weight moved and no schedule step; with the check off the same fit
    goes on, and train/mismatch_kl measures trainer vs engine (not vs the recomputed old)."""
    trainer = TrainController(tiny_model_path, temperature=1.0, total_steps=4, ref_kl_every_n_steps=0,
                              optimizer=partial(torch.optim.SGD, lr=0.5), old_logprobs=old_logprobs)
    batch = _batch(trainer, tokenizer)
    healthy = trainer.fit(batch, 0)
    assert healthy["sync/tokens"] == sum(sum(s.loss_mask) for s in batch)
    assert healthy["sync/logprob_diff_max"] < 1e-5 and healthy["train/mismatch_kl"] < 1e-9

    shifted = _batch(trainer, tokenizer, shift=0.01, version=1)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(SyncMismatch, match="policy version 1 did not land"):
        trainer.fit(shifted, 1)
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.fits_done == 1

    trainer.sync_check = trainer.update.sync_check = SyncCheck(bound="off")
    went_on = trainer.fit(shifted, 1)
    assert went_on["sync/logprob_diff_p99"] == pytest.approx(0.01, rel=1e-3)
    assert went_on["train/mismatch_kl"] == pytest.approx(0.01**2 / 2, rel=0.05)  # k3 ~ x^2 / 2
    assert not all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_tokens_of_an_older_version_are_not_checked(tiny_model_path, tokenizer):
    """Under the async scheduler: staleness > 0 tokens came from other weights."""
    trainer = TrainController(tiny_model_path, temperature=1.0, total_steps=2, ref_kl_every_n_steps=0,
                              optimizer=partial(torch.optim.SGD, lr=0.5))
    batch = _batch(trainer, tokenizer, shift=0.5)  # generated at version 0
    metrics = trainer.fit(batch, 1)  # trained as version 1: every token 1 version stale
    assert metrics["sync/tokens"] == 0 and "sync/logprob_diff_p99" not in metrics


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_replies_sampled_under_a_grammar_are_not_compared(tiny_model_path, tokenizer, old_logprobs):
    """A guided reply's engine logprobs are of the grammar-masked distribution (a forced token:
    0.0): those tokens are left out, the others still compared; a penalty or a logit bias too."""
    trainer = TrainController(tiny_model_path, temperature=1.0, total_steps=2, ref_kl_every_n_steps=0,
                              optimizer=partial(torch.optim.SGD, lr=0.5), old_logprobs=old_logprobs)
    batch = _batch(trainer, tokenizer)
    reshaped = [{"constraint": {"kind": "regex", "spec": "1[0-9]"}}, {"logit_bias": {7: 5.0}}]
    for s, sampling in zip(batch[:2], reshaped):
        start = s.loss_mask.index(1)
        s.trace.turns = [{"role": "user", "span": [0, start], "mask": 0},
                         {"role": "assistant", "span": [start, len(s.tokens)], "mask": 1,
                          "sampling": sampling}]
        s.trace.logprobs = [0.0] * len(s.tokens)
    batch[2].trace.turns = [{"role": "assistant", "span": [0, len(batch[2].tokens)], "mask": 1,
                             "sampling": {"top_logprobs": 3}}]  # alternatives asked for: not reshaped
    first = batch[0]
    assert first.trace.model_sampled() == [1] * first.loss_mask.index(1) + [0] * first.response_length
    metrics = trainer.fit(batch, 0)
    assert metrics["sync/tokens"] == sum(s.response_length for s in batch[2:])
    assert metrics["sync/logprob_diff_max"] < 1e-5
