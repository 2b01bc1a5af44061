"""What each test file costs, to order `make test`'s work: a worker that starts a long file
last keeps the whole suite waiting. The seconds come from a run's JUnit reports
(scripts/test_durations.py writes tests/durations.json); a file not listed counts as 0."""

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

SECONDS = json.loads((Path(__file__).with_name("durations.json")).read_text())


def group_seconds(groups: Iterable[str], members: dict[str, tuple[str, ...]]) -> dict[str, float]:
    """Seconds per xdist group: a file's own (a group named after its file), or the sum of
    the files `members` lists for the group."""
    cost: dict[str, float] = defaultdict(float)
    for group in set(groups):
        cost[group] = sum(SECONDS.get(f, 0.0) for f in members.get(group, (group,)))
    return cost
