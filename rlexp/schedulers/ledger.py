"""What every scheduler keeps about the groups it does not train: the filter that rejects
groups without signal, and the counts of rejected samples and of tokens generated but never
trained. Each scheduler holds one `GroupLedger`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from rlexp.sample import Sample, Status


def has_no_signal(group: list[Sample]) -> bool:
    """True when the group's completed samples all got the same reward: its GRPO advantages
    are all zero, so training on it only dilutes the batch."""
    return len({s.reward for s in group if s.status == Status.COMPLETED}) <= 1


def trained_tokens(group: list[Sample]) -> int:
    return sum(s.response_length for s in group if s.status == Status.COMPLETED)


class GroupLedger:
    """`filter_zero_variance`: groups without reward variance are rejected as FILTERED."""

    def __init__(self, filter_zero_variance: bool = False):
        self.filter_zero_variance = filter_zero_variance
        self.counts: Counter[str] = Counter()

    def keeps(self, group: list[Sample], generated: int) -> bool:
        """Whether the filter keeps a finished group; a group it drops is rejected here."""
        if self.filter_zero_variance and has_no_signal(group):
            self.reject(group, Status.FILTERED, generated)
            return False
        return True

    def reject(self, group: list[Sample], status: Status, generated: int) -> None:
        """The group is never trained: its samples get `status`, its `generated` tokens count."""
        for s in group:
            if s.status in (Status.COMPLETED, Status.INIT):
                s.status = status
        self.counts[f"samples/{status.value}"] += len(group)
        self.counts["rollout/untrained_tokens"] += generated

    def trains(self, group: list[Sample], generated: int) -> None:
        """The group goes into a batch: the tokens generated for it but not trained count."""
        self.counts["rollout/untrained_tokens"] += generated - trained_tokens(group)

    def pop(self) -> dict[str, float]:
        out = {k: float(v) for k, v in self.counts.items()}
        self.counts.clear()
        return out

    def state_dict(self, rejecting: Sequence[tuple[list[Sample], Status, int]] = ()) -> dict:
        """The counts, with the groups in `rejecting` (group, status, generated tokens) counted
        as rejected: groups already cancelled whose rejection has not been booked yet, which
        a resumed run would otherwise never count."""
        counts = Counter(self.counts)
        for group, status, generated in rejecting:
            counts[f"samples/{status.value}"] += len(group)
            counts["rollout/untrained_tokens"] += generated
        return {"counts": dict(counts)}

    def load_state_dict(self, state: dict) -> None:
        self.counts = Counter(state["counts"])
