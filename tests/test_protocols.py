"""Every component fits the Protocol it is held by (rlexp/protocols.py): here at run time,
method by method, and statically by mypy (`make lint` type-checks this file too)."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import pytest

from rlexp import protocols as P
from rlexp.agents.faulty import FaultyAgent
from rlexp.agents.multiturn import MultiTurnAgent
from rlexp.agents.openai_agent import OpenAIAgent
from rlexp.agents.single_turn import SingleTurnAgent
from rlexp.agents.tool import ToolAgent
from rlexp.evaluator import Evaluator
from rlexp.guards import AgentGuard, JudgeGuard
from rlexp.judges.faulty import FaultyJudge
from rlexp.judges.math_exact import MathExactJudge, MultiTurnJudge
from rlexp.rollout.hf_engine import HFEngine
from rlexp.rollout.vllm_engine import VLLMEngine
from rlexp.rollout.weights import RamFileTransport
from rlexp.schedulers.async_scheduler import AsyncScheduler
from rlexp.schedulers.sync import SyncScheduler
from rlexp.tools.calculator import Calculator
from rlexp.tools.python_sandbox import PythonExpression
from rlexp.tracking.mlflow_tracker import MlflowTracker
from rlexp.trainer.grpo import GRPOTrainer

FITS = [
    (VLLMEngine, P.RolloutEngine), (HFEngine, P.RolloutEngine),
    (VLLMEngine, P.LoadsWeightFiles), (HFEngine, P.LoadsWeightFiles),
    (RamFileTransport, P.WeightTransport),
    *[(agent, P.Agent) for agent in (SingleTurnAgent, MultiTurnAgent, ToolAgent, OpenAIAgent,
                                      FaultyAgent, AgentGuard)],
    *[(judge, P.Judge) for judge in (MathExactJudge, MultiTurnJudge, FaultyJudge, JudgeGuard)],
    (SyncScheduler, P.Scheduler), (AsyncScheduler, P.Scheduler),
    (GRPOTrainer, P.Trainer), (Evaluator, P.Evaluator), (MlflowTracker, P.Tracker),
    (Calculator, P.Tool), (PythonExpression, P.Tool),
]


def _methods(protocol) -> dict:
    return {name: member for name, member in vars(protocol).items()
            if inspect.isfunction(member) and (not name.startswith("_") or name == "__call__")}


@pytest.mark.parametrize("impl, protocol", FITS, ids=lambda x: x.__name__)
def test_every_method_of_the_protocol_is_there_with_its_parameters(impl, protocol):
    assert _methods(protocol), protocol  # the check looks at something
    for name, wanted in _methods(protocol).items():
        got = getattr(impl, name, None)
        assert got is not None, f"{impl.__name__} has no {name}"
        want_params = list(inspect.signature(wanted).parameters)
        assert list(inspect.signature(got).parameters)[:len(want_params)] == want_params, name
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), name


def test_the_check_catches_a_component_that_does_not_fit():
    class OldJudge:
        def score(self, sample):  # not async
            return sample

    with pytest.raises(AssertionError, match="score"):
        test_every_method_of_the_protocol_is_there_with_its_parameters(OldJudge, P.Judge)


if TYPE_CHECKING:  # mypy rejects each return below if the class does not fit its Protocol
    def _engines(v: VLLMEngine, h: HFEngine) -> list[P.RolloutEngine]:
        return [v, h]

    def _loaders(v: VLLMEngine, h: HFEngine) -> list[P.LoadsWeightFiles]:
        return [v, h]

    def _transport(t: RamFileTransport) -> P.WeightTransport:
        return t

    def _agents(a: SingleTurnAgent, b: MultiTurnAgent, c: ToolAgent, d: OpenAIAgent, e: FaultyAgent,
                f: AgentGuard) -> list[P.Agent]:
        return [a, b, c, d, e, f]

    def _judges(a: MathExactJudge, b: MultiTurnJudge, c: FaultyJudge, d: JudgeGuard) -> list[P.Judge]:
        return [a, b, c, d]

    def _schedulers(a: SyncScheduler, b: AsyncScheduler) -> list[P.Scheduler]:
        return [a, b]

    def _rest(t: GRPOTrainer, e: Evaluator, m: MlflowTracker) -> tuple[P.Trainer, P.Evaluator, P.Tracker]:
        return t, e, m

    def _tools(a: Calculator, b: PythonExpression) -> list[P.Tool]:
        return [a, b]
