"""DataManager: draws prompt groups, holds the replay buffer, forms train batches."""

from __future__ import annotations

import random
from collections import deque

from rlexp.data.sources import Problem
from rlexp.sample import Sample, Status


class DataManager:
    """Draws `prompts_per_step` groups of `samples_per_prompt` Samples per step.

    Train splits are reshuffled every epoch (by `seed`); other splits keep file order,
    so an evaluation over `len(manager)` prompts covers each exactly once."""

    def __init__(self, source, prompts_per_step: int, samples_per_prompt: int, seed: int,
                 split: str = "train", replay_buffer_size: int = 4096):
        self.problems: list[Problem] = source.problems(split)
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.split = split
        self.replay_buffer_size = replay_buffer_size
        self.seed = seed
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._next_group = 0
        self._buffer: deque[list[Sample]] = deque()
        self._new_epoch()  # now, not on the first draw: keep the shuffle off the rollout path

    def __len__(self) -> int:
        return len(self.problems)

    def _new_epoch(self) -> None:
        self._order = list(range(len(self.problems)))
        if self.split == "train":
            self._rng.shuffle(self._order)
        self._order.reverse()

    def _next_problem(self) -> Problem:
        if not self._order:
            self._new_epoch()
        return self.problems[self._order.pop()]

    def sample_groups(self, n: int) -> list[list[Sample]]:
        groups = []
        for _ in range(n):
            p = self._next_problem()
            gid, self._next_group = self._next_group, self._next_group + 1
            # A per-sample seed fixed by (seed, group, index): the same run config rolls out the
            # same tokens whatever the order in which requests are issued or finish.
            groups.append([Sample(group_id=gid, prompt=p.messages, answer=p.answer,
                                  metadata={"seed": hash((self.seed, gid, i)) & 0x7FFFFFFF})
                           for i in range(self.samples_per_prompt)])
        return groups

    def put(self, groups: list[list[Sample]]) -> None:
        """Add finished groups to the replay buffer (oldest dropped past its size)."""
        for g in groups:
            self._buffer.append(g)
            while len(self._buffer) > self.replay_buffer_size:
                for s in self._buffer.popleft():
                    s.status = Status.ARCHIVED

    def get_batch(self, n_groups: int | None = None) -> list[Sample]:
        """Pop up to `n_groups` (default `prompts_per_step`) groups, oldest first."""
        n = self.prompts_per_step if n_groups is None else n_groups
        batch: list[Sample] = []
        for _ in range(min(n, len(self._buffer))):
            batch.extend(self._buffer.popleft())
        return batch

    def state_dict(self) -> dict:
        """The position in the data (shuffle state, epoch order, next group id) and the buffer."""
        return {"rng": self._rng.getstate(), "order": list(self._order), "next_group": self._next_group,
                "buffer": list(self._buffer), "n_problems": len(self.problems)}

    def load_state_dict(self, state: dict) -> None:
        if state["n_problems"] != len(self.problems):
            raise ValueError(f"the {self.split} split has {len(self.problems)} prompts, the checkpoint "
                             f"was taken with {state['n_problems']}: the dataset changed")
        self._rng.setstate(state["rng"])
        self._order = list(state["order"])
        self._next_group = state["next_group"]
        self._buffer = deque(state["buffer"])

    @property
    def buffered_groups(self) -> int:
        return len(self._buffer)
