"""Agent and judge faults through the guards and schedulers (fakes for the engine; the real
runs with injected faults are in test_resume.py)."""

import asyncio
import math
import traceback

import pytest

from rlexp.agents.faulty import FaultyAgent
from rlexp.errors import EngineDead, JudgeError, ProgrammingError
from rlexp.guards import AgentGuard, JudgeGuard
from rlexp.judges.faulty import FaultyJudge
from rlexp.judges.math_exact import MathExactJudge
from rlexp.metrics import rollout_metrics
from rlexp.sample import Sample, Status
from rlexp.schedulers.async_scheduler import AsyncScheduler
from rlexp.schedulers.sync import SyncScheduler, collect, rollout_group
from rlexp.step import rl_step
from tests.fakes import UNCHECKED, TimedEngine, VersionOnlyTransport
from tests.test_schedulers import CountingAgent, SleepyTrainer, _data

HANG_FAILSAFE_S = 60  # turns a guard that never fires (the hangs are endless) into a failure


class ScoringAgent(CountingAgent):
    """CountingAgent whose reward comes from a judge (a `response_text` the judge reads)."""

    def __init__(self, engine, judge):
        super().__init__(engine)
        self.judge = judge

    async def rollout(self, s):
        s = await super().rollout(s)
        s.response_text = "#### " + s.answer if s.metadata["seed"] % 2 else "#### 0"
        return await self.judge.score(s)


def _group(n=4, gid=0):
    return [Sample(group_id=gid, prompt=[{"role": "user", "content": "1+1="}], answer="2",
                   metadata={"seed": 1000 * gid + i}) for i in range(n)]


def _agent(engine=None, judge=None, agent_timeout=None, judge_timeout=None, **rates):
    """Faults hang forever (only a guard ends them); healthy work takes no time (an engine
    without per-token delay), so which guard fires never depends on the machine's speed."""
    engine = engine or TimedEngine(token_s=0)
    judge_rates = {k[6:]: v for k, v in rates.items() if k.startswith("judge_")}
    agent_rates = {k[6:]: v for k, v in rates.items() if k.startswith("agent_")}
    judge = JudgeGuard(FaultyJudge(MathExactJudge(), hang_s=math.inf, **judge_rates), judge_timeout)
    faulty = FaultyAgent(engine, None, judge, inner=lambda engine, judge, **_: ScoringAgent(engine, judge),
                         hang_s=math.inf, **agent_rates)
    return AgentGuard(faulty, agent_timeout)


def _roll(agent, n=4):
    return asyncio.run(asyncio.wait_for(rollout_group(agent, _group(n), [0]), HANG_FAILSAFE_S))


@pytest.mark.parametrize("rates, status, reason", [
    (dict(agent_raise_rate=1.0), Status.FAILED, "agent raised InjectedFault: injected agent fault"),
    (dict(agent_hang_rate=1.0), Status.ABORTED, "agent timed out after 1s (agent.guard.timeout_s)"),
    (dict(judge_raise_rate=1.0), Status.FAILED, "judge raised InjectedFault: injected judge fault"),
    (dict(judge_hang_rate=1.0), Status.FAILED, "judge timed out after 0.1s (judge.guard.timeout_s)"),
    (dict(judge_nan_rate=1.0), Status.FAILED, "judge returned a reward that is not a finite number: nan"),
])
def test_each_fault_marks_the_sample_with_its_reason(rates, status, reason):
    """A hang never ends by itself: a hung sample comes back only because its guard cut it off."""
    out = _roll(_agent(agent_timeout=1, judge_timeout=0.1, **rates))
    assert [s.status for s in out] == [status] * 4
    assert all(s.error == reason for s in out)
    assert all(s.to_trace(str)["error"] == reason for s in out)  # the reason is in the trace


def test_without_faults_nothing_is_marked():
    out = _roll(_agent(agent_timeout=5, judge_timeout=5))
    assert [s.status for s in out] == [Status.COMPLETED] * 4
    assert all(s.error is None and math.isfinite(s.reward) for s in out)
    assert {s.reward for s in out} == {0.0, 1.0}


def test_a_dead_engine_stops_the_step_instead_of_failing_samples():
    with pytest.raises(EngineDead):
        collect(_group(2), [EngineDead("gone"), _group(1)[0]])


@pytest.mark.parametrize("scheduler", [SyncScheduler, lambda: AsyncScheduler(staleness_threshold=1)])
def test_runs_go_on_through_mixed_faults_and_count_them(scheduler):
    async def go():
        engine = TimedEngine(token_s=0)
        agent = _agent(engine, agent_timeout=0.5, judge_timeout=0.1, agent_raise_rate=0.1,
                       agent_hang_rate=0.1, judge_raise_rate=0.1, judge_nan_rate=0.1, judge_hang_rate=0.1)
        sched, trainer, data = scheduler(), SleepyTrainer(0.01), _data()
        steps = []
        try:
            for version in range(4):
                steps.append(await rl_step(sched, data, agent, engine, trainer, VersionOnlyTransport(),
                                           version))
        finally:
            await sched.aclose()
        return steps, trainer

    steps, trainer = asyncio.run(go())
    assert len(trainer.batches) == 4 and all(len(b) == 16 for b in trainer.batches)
    batches = [batch for batch, _ in steps]
    steps = [m for _, m in steps]
    failed = sum(s.status == Status.FAILED for b in batches for s in b)
    aborted = sum(s.status == Status.ABORTED for b in batches for s in b)
    assert failed > 0 and aborted > 0  # ~40% and ~10% of 64 samples
    assert sum(m["samples/failed"] for m in steps) == failed
    fracs = [rollout_metrics(b, 0)["samples/failed_frac"] for b in batches]
    assert fracs == [sum(s.error is not None for s in b) / 16 for b in batches]
    assert 0.2 < sum(fracs) / 4 < 0.8
    reasons = {s.error.split(" (")[0] for b in batches for s in b if s.error}
    assert {"agent raised InjectedFault: injected agent fault", "agent timed out after 0.5s",
            "judge raised InjectedFault: injected judge fault", "judge timed out after 0.1s",
            "judge returned a reward that is not a finite number: nan"} == reasons


def test_failed_samples_do_not_shift_their_groups_advantages(tiny_model_path):
    import torch

    from rlexp.sample import TokenTrace
    from rlexp.trainer import update
    from rlexp.trainer.batch import TrainBatch, trained
    from rlexp.trainer.controller import TrainController

    trainer = TrainController(tiny_model_path, 1.0, lambda p: torch.optim.AdamW(p, lr=1e-4), total_steps=1,
                              ref_kl_every_n_steps=0, sync_check=UNCHECKED)
    batch = _group(3)
    for s, r, st in zip(batch, (1.0, 0.0, 0.0), (Status.COMPLETED, Status.COMPLETED, Status.FAILED)):
        s.reward, s.status = r, st
        s.trace = TokenTrace([5, 6, 7], [0, 0, 1], [0.0, 0.0, -1.0], [0, 0, 0])
    learner = trainer.learner
    rows = trained(batch)
    assert rows == batch[:2]  # the failed sample is no row
    tb = TrainBatch.build(rows, 0, learner.layout)
    signals = update.advantages(learner, tb, update.old_logprobs(learner, tb), None, None)
    adv = signals.advantages  # [trained rows, tokens - 1]: the trained token is the last
    assert adv.shape[0] == 2
    assert adv[:, -1].tolist() == pytest.approx([1.0, -1.0], abs=1e-4)  # as if the failed one were absent


def test_a_hung_agent_is_aborted_where_asyncio_timeouts_are_their_own_class(monkeypatch):
    """Python 3.10: `asyncio.wait_for` raises `asyncio.TimeoutError`, which is not the builtin
    TimeoutError (they are one class from 3.11). Simulated here by making them two classes."""
    class AsyncioTimeout(Exception):
        pass

    async def times_out(aw, timeout):
        aw.close()
        raise AsyncioTimeout

    monkeypatch.setattr(asyncio, "TimeoutError", AsyncioTimeout)
    monkeypatch.setattr(asyncio, "wait_for", times_out)
    guarded = AgentGuard(ScoringAgent(TimedEngine(token_s=0), MathExactJudge()), 1)
    out = asyncio.run(guarded.rollout(_group(1)[0]))
    assert out.status is Status.ABORTED and out.error == "agent timed out after 1s (agent.guard.timeout_s)"
    with pytest.raises(JudgeError, match="judge timed out after 1s"):
        asyncio.run(JudgeGuard(MathExactJudge(), 1).score(_group(1)[0]))


class BuggyJudge:
    """A judge with a bug of the kind a user's reward function has: a wrong type."""

    async def score(self, s):
        s.reward = len(s.response_text) + None
        return s


def test_a_programming_error_in_a_judge_stops_the_run_with_its_traceback():
    agent = AgentGuard(ScoringAgent(TimedEngine(token_s=0), JudgeGuard(BuggyJudge(), 5)))
    with pytest.raises(ProgrammingError, match="agent raised TypeError") as stopped:
        _roll(agent)
    assert isinstance(stopped.value.__cause__, TypeError)
    frames = traceback.extract_tb(stopped.value.__cause__.__traceback__)
    assert frames[-1].name == "score" and "+ None" in frames[-1].line  # the user's line


@pytest.mark.parametrize("error, status", [(TypeError("x"), None), (NameError("x"), None),
                                           (ValueError("bad reply"), Status.FAILED),
                                           (KeyError("tool"), Status.FAILED)])
def test_programming_errors_stop_environment_faults_are_counted(error, status):
    if status is None:
        with pytest.raises(ProgrammingError):
            collect(_group(2), [error, _group(1)[0]])
    else:
        assert collect(_group(2), [error, _group(1)[0]])[0][0].status is status


class DyingAgent:
    """Group 0's rollout finds the engine dead; every other group's rollout never ends."""

    def __init__(self):
        self.cancelled = []

    async def rollout(self, s):
        if s.group_id == 0:
            raise EngineDead("gone")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(s.group_id)
            raise


def test_a_dead_engine_cancels_the_other_groups_of_the_step():
    async def go():
        agent = DyingAgent()
        with pytest.raises(EngineDead):
            await asyncio.wait_for(SyncScheduler().produce_batch(_data(groups=3), agent, 0), HANG_FAILSAFE_S)
        return sorted(set(agent.cancelled))

    assert asyncio.run(go()) == [1, 2]  # cancelled before produce_batch raised, not left running
