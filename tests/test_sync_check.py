"""The in-run sync check (rlexp/trainer/sync_check.py) on hand-made figures and on the tiny
model's trainer: what it measures, when it stops, and that it stops before the optimizer step;
the batch's own token versions against the trainer's, in the loop's step (rl_step) with a timed
fake engine whose pushes reach it or not.
The planted faults against a real engine are in the engine modules (test_engines.py,
test_lora_engine.py, test_moe.py); a whole run that stops: test_run_stops.py."""

import asyncio
from dataclasses import replace
from functools import partial

import pytest
import torch

from rlexp.algorithms.objective import kl_estimate
from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource
from rlexp.errors import SyncMismatch, SyncUnchecked
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.schedulers.async_scheduler import AsyncScheduler
from rlexp.schedulers.sync import SyncScheduler
from rlexp.step import rl_step
from rlexp.trainer.controller import TrainController
from rlexp.trainer.sync_check import AUTO_BOUNDS, SyncCheck, check_compared, check_versions, resolve_bound
from tests.fakes import TimedEngine, VersionOnlyTransport
from tests.test_schedulers import CountingAgent


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
    assert trainer.learner.fits_done == 1

    trainer.learner = replace(trainer.learner, sync_check=SyncCheck(bound="off"))
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


def _generated(versions_per_sample, status=Status.COMPLETED, turns=None):
    """Samples of a 2-token prompt and one reply token per entry of `versions`."""
    out = []
    for i, versions in enumerate(versions_per_sample):
        trace = TokenTrace([1, 2] + [7] * len(versions), [0, 0] + [1] * len(versions),
                           [0.0] * (2 + len(versions)), [-1, -1] + list(versions))
        if turns is not None:
            trace.turns = turns(len(versions))
        out.append(Sample(group_id=i, prompt=[], answer="", trace=trace, status=status))
    return out


def test_trained_tokens_older_than_the_scheduler_allows_stop_the_step_naming_the_versions():
    """The sync scheduler allows no stale token, the async one η: the engine still serving
    version 0 at version 2 is refused by both, with the versions and the likely cause."""
    stale = _generated([[2, 2], [0, 0, 0]])
    with pytest.raises(SyncMismatch, match=r"policy version 2 was trained on tokens the engine generated at "
                                           r"version 0 \(3 of the batch's 5 trained tokens .* scheduler's 1 "
                                           r"versions old, staleness up to 2\).*did not reach the engine"):
        check_versions(stale, 2, max_staleness=1)
    assert check_versions(_generated([[1, 2], [2]]), 2, max_staleness=1) == 0  # within η: nothing to count
    with pytest.raises(SyncMismatch, match="generated at version 1"):
        check_versions(_generated([[1, 2], [2]]), 2, max_staleness=0)
    assert check_versions(_generated([[0, 0]], status=Status.FAILED), 2, max_staleness=0) == 0  # not trained


def test_where_no_token_may_be_stale_the_check_must_compare_some():
    """Bound 0: the tokens the check must compare are the trained ones the model sampled
    unreshaped; a fit that reports none compared stops the run. A reply under a grammar has
    nothing to compare, and a trainer without the check (no sync/tokens) is not asked."""
    batch = _generated([[3, 3], [3]])
    assert check_versions(batch, 3, max_staleness=0) == 3
    with pytest.raises(SyncUnchecked, match=r"policy version 3 was not checked: the batch held 3 tokens "
                                            r"generated at version 3 .* compared none"):
        check_compared({"sync/tokens": 0.0}, 3, 3)
    check_compared({"sync/tokens": 3.0}, 3, 3)
    check_compared({}, 3, 3)
    guided = _generated([[3, 3]], turns=lambda n: [
        {"role": "user", "span": [0, 2], "mask": 0},
        {"role": "assistant", "span": [2, 2 + n], "mask": 1, "sampling": {"constraint": {"kind": "regex"}}}])
    assert check_versions(guided, 3, max_staleness=0) == 0
    check_compared({"sync/tokens": 0.0}, 3, 0)


class _NeverLoads:
    """A transport whose push never reaches the engine: its version stays where it was."""

    async def transfer(self, weights, engine, version):
        assert not list(weights)

    def close(self):
        pass


class _Reports:
    """A trainer with no weights whose fit reports `sync/tokens` as given."""

    def __init__(self, compared):
        self.compared, self.versions = compared, []

    def fit(self, batch, version):
        self.versions.append(version)
        return {"sync/tokens": float(self.compared)}

    def weights(self):
        return iter(())


FAILSAFE_S = 120.0  # a scheduler that expires every group without end never returns a batch


def _steps(scheduler, trainer, transport, steps=3):
    """`steps` loop steps of the scheduled engine's tokens (TimedEngine), the versions 0, 1, ..."""
    engine = TimedEngine(token_s=0.0001, max_tokens=4, mean_len=2.0)
    data = DataManager(ArithmeticSource(max_operand=9, ops="+", eval_size=4, seed=0), prompts_per_step=2,
                       samples_per_prompt=2, seed=0)

    async def run():
        try:
            for version in range(steps):
                await rl_step(scheduler, data, CountingAgent(engine), engine, trainer, transport, version)
        finally:
            await scheduler.aclose()

    asyncio.run(asyncio.wait_for(run(), FAILSAFE_S))


@pytest.mark.parametrize("scheduler, trained", [(SyncScheduler, [0]),
                                                (partial(AsyncScheduler, staleness_threshold=0), [0]),
                                                (partial(AsyncScheduler, staleness_threshold=1), [0, 1])])
def test_the_loop_step_refuses_the_tokens_of_an_engine_the_sync_never_reached(scheduler, trained):
    """Step 1 trains version 0 on version 0's tokens; the push of version 1 never reaches the
    engine. The sync scheduler's step 2 stops before its fit (the batch's tokens are 1 version
    stale); the async scheduler stops as a group launched after the push comes back with
    version 0's tokens (at step 2 with η = 0; with η = 1 step 2 trains the groups launched at
    version 0, allowed, and step 3 stops), where its bound would expire them without end."""
    trainer = _Reports(compared=4)
    with pytest.raises(SyncMismatch, match=r"version 1\b.* tokens the engine generated at version 0"):
        _steps(scheduler(), trainer, _NeverLoads(), steps=4)
    assert trainer.versions == trained
    healthy = _Reports(compared=4)
    _steps(scheduler(), healthy, VersionOnlyTransport(), steps=4)
    assert healthy.versions == [0, 1, 2, 3]


def test_the_loop_step_refuses_a_fit_whose_check_compared_none():
    trainer = _Reports(compared=0)
    with pytest.raises(SyncUnchecked, match="policy version 0 was not checked"):
        _steps(SyncScheduler(), trainer, VersionOnlyTransport())
    assert trainer.versions == [0]
