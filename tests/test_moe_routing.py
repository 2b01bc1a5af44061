"""MoE routing data on hand-made arrays, no engine: how a trace stitches its generations'
routing (rlexp/sample.py: stitch_routing), the expert-load metrics (rlexp/metrics.py)."""

import numpy as np

from rlexp.metrics import expert_load, rollout_metrics
from rlexp.sample import Generation, Sample, Status, TokenTrace, stitch_routing


def test_expert_load_is_the_busiest_experts_share_per_layer_and_counts_the_bytes():
    # two samples' routing [positions, layers=2, k=2]; layer 0 slots: 0,1,0,2 | 0,0 ; layer 1: 2,3,2,3 | 1,3
    a = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 3]]], dtype=np.uint8)
    b = np.array([[[0, 0], [1, 3]]], dtype=np.uint8)
    out = expert_load([a, None, b])
    assert out == {"moe/routing_bytes": 12.0,
                   "moe/expert_load_max/layer_0": 4 / 6,  # expert 0 in 4 of 6 slots
                   "moe/expert_load_max/layer_1": 3 / 6}  # expert 3 in 3 of 6
    assert expert_load([None]) == {}


def test_rollout_metrics_carry_the_expert_load_of_completed_samples_only():
    def sample(routing, status):
        trace = TokenTrace(tokens=[1, 2, 3])
        trace.routed_experts = routing
        return Sample(group_id=0, prompt=[], answer="", trace=trace, status=status)

    busy = np.zeros((2, 1, 2), dtype=np.uint8)  # everything to expert 0
    spread = np.array([[[0, 1]], [[2, 3]]], dtype=np.uint8)
    metrics = rollout_metrics([sample(spread, Status.COMPLETED), sample(busy, Status.FAILED)], version=0)
    assert metrics["moe/expert_load_max/layer_0"] == 0.25 and metrics["moe/routing_bytes"] == 4.0
    assert "moe/routing_bytes" not in rollout_metrics([sample(None, Status.COMPLETED)], version=0)


def _routing(positions: int, value: int) -> np.ndarray:
    return np.full((positions, 2, 2), value, dtype=np.uint8)


def test_a_position_keeps_the_routing_of_the_request_that_first_computed_it():
    first = _routing(4, 1)  # a request over 3 prompt tokens + 2 generated: positions 0..3
    later = _routing(7, 2)  # the next turn's request: the same 5 tokens, 2 more, 1 generated
    stitched = stitch_routing(first, later)
    assert stitched.shape == (7, 2, 2)
    assert (stitched[:4] == 1).all() and (stitched[4:] == 2).all()
    assert stitch_routing(None, later) is later and stitch_routing(first, None) is first
    assert stitch_routing(first, _routing(3, 2)) is first  # a shorter later request adds nothing


def test_a_trace_stitches_its_turns_routing_and_copies_share_it():
    trace = TokenTrace()
    trace.append([5, 6, 7], role="prompt")
    trace.append([8, 9], role="assistant", generation=Generation([8, 9], [-0.1, -0.2], "stop", [0, 0],
                                                                 routed_experts=_routing(4, 1)))
    trace.append([10], role="user")
    trace.append([11], role="assistant", generation=Generation([11], [-0.3], "stop", [1],
                                                               routed_experts=_routing(6, 2)))
    assert trace.routed_experts.shape == (6, 2, 2) and len(trace) == 7  # positions 0..len-2
    assert (trace.routed_experts[:4] == 1).all() and (trace.routed_experts[4:] == 2).all()
    assert trace.copy().routed_experts is trace.routed_experts
