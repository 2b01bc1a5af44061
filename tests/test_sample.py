"""The token trace keeps its per-token lists aligned; staleness has one definition."""

from rlexp.sample import Generation, Sample, Status, TokenTrace, staleness


def _trace() -> TokenTrace:
    t = TokenTrace()
    t.append([5, 6, 7], role="prompt", text="q")
    t.append([8, 9], role="assistant", text="a", generation=Generation([8, 9], [-0.1, -0.2], "stop", [3, 4]))
    t.append([10], role="user", text="again")
    return t


def test_append_keeps_every_list_aligned_and_records_each_span():
    t = _trace()
    assert t.tokens == [5, 6, 7, 8, 9, 10]
    assert t.loss_mask == [0, 0, 0, 1, 1, 0]
    assert t.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0]
    assert t.versions == [-1, -1, -1, 3, 4, -1]
    assert [(x["role"], x["span"], x["mask"]) for x in t.turns] == [
        ("prompt", [0, 3], 0), ("assistant", [3, 5], 1), ("user", [5, 6], 0)]


def test_copy_is_independent():
    t = _trace()
    c = t.copy()
    c.append([11], role="user")
    assert len(t) == 6 and len(c) == 7 and len(t.turns) == 3


def test_sample_reads_its_trace_and_measures_staleness_from_the_oldest_trained_token():
    s = Sample(group_id=0, prompt=[], answer="", trace=_trace(), status=Status.COMPLETED)
    assert s.tokens is s.trace.tokens and s.versions is s.trace.versions
    assert s.response_length == 2 and s.oldest_version == 3
    assert s.staleness(6) == staleness(6, 3) == 3
    assert s.token_staleness(6) == [7, 7, 7, 3, 2, 7]  # prompt tokens (version -1) are masked out
    assert Sample(group_id=0, prompt=[], answer="").staleness(6) == 0  # nothing trained
