"""Every component fits the Protocol it is held by (rlexp/protocols.py, rlexp/weights/protocols.py,
rlexp/cluster Cluster, rlexp/data/sources.py PromptSource): here at run time, method by method
and attribute by attribute, from the classes alone (no engine, Ray or vLLM started), and
statically by mypy (`make lint` type-checks this file too)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import TYPE_CHECKING, Protocol

import pytest

from rlexp import protocols as P
from rlexp.agents.environment import EnvironmentAgent, MethodTool, OpenEnvAgent
from rlexp.agents.faulty import FaultyAgent
from rlexp.agents.multiturn import MultiTurnAgent
from rlexp.agents.openai_agent import OpenAIAgent
from rlexp.agents.single_turn import SingleTurnAgent
from rlexp.agents.tool import ToolAgent
from rlexp.agents.verifiers_agent import VerifiersAgent
from rlexp.cluster import Cluster, LocalCluster
from rlexp.cluster.pool import RolloutPool
from rlexp.cluster.ray_cluster import RayCluster
from rlexp.cluster.trainer_group import TrainerGroup
from rlexp.data.file_sources import HFDiskSource, JsonlSource, ParquetSource
from rlexp.data.shapes import ShapesSource
from rlexp.data.sources import ArithmeticSource, HubSource, PromptSource
from rlexp.evaluator import Evaluator
from rlexp.guards import AgentGuard, JudgeGuard
from rlexp.judges.faulty import FaultyJudge
from rlexp.judges.math_exact import MathExactJudge, MultiTurnJudge
from rlexp.judges.reasoning_gym import ReasoningGymJudge
from rlexp.rollout.hf_engine import HFEngine
from rlexp.rollout.vllm_engine import VLLMEngine
from rlexp.schedulers.async_scheduler import AsyncScheduler
from rlexp.schedulers.sync import SyncScheduler
from rlexp.tools.calculator import Calculator
from rlexp.tools.python_sandbox import PythonExpression
from rlexp.tools.zoom import Zoom
from rlexp.tracking.mlflow_tracker import MlflowTracker
from rlexp.trainer.controller import TrainController
from rlexp.weights import protocols as W
from rlexp.weights.adapter_file import AdapterFileTransport
from rlexp.weights.object_store import ObjectStoreTransport
from rlexp.weights.ram_file import RamFileTransport
from rlexp.weights.vllm_ipc import VllmIpcTransport
from rlexp.weights.vllm_nccl import VllmNcclTransport

TRANSPORTS = (RamFileTransport, ObjectStoreTransport, VllmIpcTransport, VllmNcclTransport,
              AdapterFileTransport)
SOURCES = (ArithmeticSource, JsonlSource, ParquetSource, HFDiskSource, HubSource, ShapesSource)
FITS = [
    (VLLMEngine, P.RolloutEngine), (HFEngine, P.RolloutEngine), (RolloutPool, P.RolloutEngine),
    *[(engine, W.LoadsWeightFiles) for engine in (VLLMEngine, HFEngine, RolloutPool)],
    (RolloutPool, W.LoadsWeightObjects),
    (VLLMEngine, W.LoadsNativeWeights), (RolloutPool, W.LoadsNativeWeights),
    *[(transport, W.WeightTransport) for transport in TRANSPORTS],
    (LocalCluster, Cluster), (RayCluster, Cluster),
    *[(agent, P.Agent) for agent in (SingleTurnAgent, MultiTurnAgent, ToolAgent, OpenAIAgent,
                                      FaultyAgent, AgentGuard, EnvironmentAgent, OpenEnvAgent,
                                      VerifiersAgent)],
    *[(judge, P.Judge) for judge in (MathExactJudge, MultiTurnJudge, FaultyJudge, JudgeGuard,
                                      ReasoningGymJudge)],
    (SyncScheduler, P.Scheduler), (AsyncScheduler, P.Scheduler),
    (TrainController, P.Trainer), (TrainerGroup, P.Trainer),
    (Evaluator, P.Evaluator), (MlflowTracker, P.Tracker),
    (Calculator, P.Tool), (PythonExpression, P.Tool), (Zoom, P.Tool), (MethodTool, P.Tool),
    *[(source, PromptSource) for source in SOURCES],
]


def _protocol_classes(protocol) -> list[type]:
    """The protocol and the protocols it extends (Cluster extends ClusterShape)."""
    return [c for c in protocol.__mro__ if c not in (Protocol, object) and getattr(c, "_is_protocol", False)]


def _methods(protocol) -> dict:
    return {name: member for c in _protocol_classes(protocol) for name, member in vars(c).items()
            if inspect.isfunction(member) and (not name.startswith("_") or name == "__call__")}


def _attributes(protocol) -> set[str]:
    """Annotated attributes and read-only properties."""
    names: set[str] = set()
    for c in _protocol_classes(protocol):
        names |= set(vars(c).get("__annotations__", {}))
        names |= {name for name, member in vars(c).items() if isinstance(member, property)}
    return names


def _set_on_self(cls: type) -> set[str]:
    """Names a class (or a class it inherits from) sets on `self` in `__init__`."""
    names: set[str] = set()
    for c in cls.__mro__:
        init = vars(c).get("__init__")
        if init is None or not inspect.isfunction(init):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self":
                        names.add(t.attr)
    return names


def _has_attribute(cls: type, name: str) -> bool:
    in_class = any(name in vars(c) or name in vars(c).get("__annotations__", {}) for c in cls.__mro__)
    return in_class or name in _set_on_self(cls)


@pytest.mark.parametrize("impl, protocol", FITS, ids=lambda x: x.__name__)
def test_every_method_of_the_protocol_is_there_with_its_parameters(impl, protocol):
    assert _methods(protocol), protocol  # the check looks at something
    for name, wanted in _methods(protocol).items():
        got = getattr(impl, name, None)
        assert got is not None, f"{impl.__name__} has no {name}"
        want_params = list(inspect.signature(wanted).parameters)
        assert list(inspect.signature(got).parameters)[:len(want_params)] == want_params, name
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(wanted), name


@pytest.mark.parametrize("impl, protocol", [(i, p) for i, p in FITS if _attributes(p)],
                         ids=lambda x: x.__name__)
def test_every_attribute_of_the_protocol_is_set(impl, protocol):
    """Set on the class, or on `self` in `__init__` (read from the source: nothing is built)."""
    for name in _attributes(protocol):
        assert _has_attribute(impl, name), f"{impl.__name__} sets no {name}"


def test_the_protocols_with_attributes_are_checked_for_them():
    assert _attributes(P.RolloutEngine) == {"version", "sampling", "max_model_len", "busy", "takes_images",
                                            "constrains_replies", "update_modes", "serves_adapters"}
    assert _attributes(W.WeightTransport) == {"engine_backend", "sends_from_driver", "sends_adapter"}
    assert _attributes(Cluster) == {"name", "multi_node", "placement", "trainer_workers", "distributed"}
    assert _attributes(PromptSource) == {"commit"} and _attributes(P.Tool) == {"spec", "reads_images"}
    assert "shutdown" in _methods(Cluster) and "rollout_engine" in _methods(Cluster)


def test_the_transports_name_the_engine_side_they_need():
    assert [t.engine_backend for t in TRANSPORTS] == [None, None, "ipc", "nccl", None]
    assert [t.sends_adapter for t in TRANSPORTS] == [False, False, False, False, True]


def test_the_checks_catch_a_component_that_does_not_fit():
    class OldJudge:
        def score(self, sample):  # not async
            return sample

    with pytest.raises(AssertionError, match="score"):
        test_every_method_of_the_protocol_is_there_with_its_parameters(OldJudge, P.Judge)

    class Transport:  # the methods, but no engine_backend
        sends_from_driver = sends_adapter = False

        def __init__(self):
            self.backend = None

        async def transfer(self, weights, engine, version): ...

        def close(self): ...

    test_every_method_of_the_protocol_is_there_with_its_parameters(Transport, W.WeightTransport)
    with pytest.raises(AssertionError, match="engine_backend"):
        test_every_attribute_of_the_protocol_is_set(Transport, W.WeightTransport)

    class Engine(Transport):
        engine_backend = None

        def __init__(self):
            super().__init__()
            self.version, self.sampling = 0, None  # no max_model_len, no busy

    test_every_attribute_of_the_protocol_is_set(Engine, W.WeightTransport)
    unset = "max_model_len|busy|takes_images|constrains_replies|update_modes|serves_adapters"
    with pytest.raises(AssertionError, match=unset):
        test_every_attribute_of_the_protocol_is_set(Engine, P.RolloutEngine)


if TYPE_CHECKING:  # mypy rejects each return below if the class does not fit its Protocol
    def _engines(v: VLLMEngine, h: HFEngine, p: RolloutPool) -> list[P.RolloutEngine]:
        return [v, h, p]

    def _loaders(v: VLLMEngine, h: HFEngine, p: RolloutPool) -> list[W.LoadsWeightFiles]:
        return [v, h, p]

    def _native(v: VLLMEngine, p: RolloutPool) -> tuple[list[W.LoadsNativeWeights], W.LoadsWeightObjects]:
        return [v, p], p

    def _transports(a: RamFileTransport, b: ObjectStoreTransport, c: VllmIpcTransport,
                    d: VllmNcclTransport, e: AdapterFileTransport) -> list[W.WeightTransport]:
        return [a, b, c, d, e]

    def _clusters(a: LocalCluster, b: RayCluster) -> list[Cluster]:
        return [a, b]

    def _shapes(a: LocalCluster, b: RayCluster) -> list[W.ClusterShape]:
        return [a, b]

    def _agents(a: SingleTurnAgent, b: MultiTurnAgent, c: ToolAgent, d: OpenAIAgent, e: FaultyAgent,
                f: AgentGuard, g: EnvironmentAgent, h: OpenEnvAgent, i: VerifiersAgent) -> list[P.Agent]:
        return [a, b, c, d, e, f, g, h, i]

    def _judges(a: MathExactJudge, b: MultiTurnJudge, c: FaultyJudge, d: JudgeGuard) -> list[P.Judge]:
        return [a, b, c, d]

    def _schedulers(a: SyncScheduler, b: AsyncScheduler) -> list[P.Scheduler]:
        return [a, b]

    def _trainers(a: TrainController, b: TrainerGroup) -> list[P.Trainer]:
        return [a, b]

    def _rest(e: Evaluator, m: MlflowTracker) -> tuple[P.Evaluator, P.Tracker]:
        return e, m

    def _tools(a: Calculator, b: PythonExpression, c: Zoom, d: MethodTool) -> list[P.Tool]:
        return [a, b, c, d]

    def _sources(a: ArithmeticSource, b: JsonlSource, c: ParquetSource, d: HFDiskSource, e: HubSource,
                 f: ShapesSource) -> list[PromptSource]:
        return [a, b, c, d, e, f]

