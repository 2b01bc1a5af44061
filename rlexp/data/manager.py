"""DataManager: draws prompt groups from a split, in a resumable order."""

from __future__ import annotations

import random

from rlexp.constraints import AtLeast1
from rlexp.data.sources import Problem, PromptSource
from rlexp.sample import Sample


class DataManager:
    """Draws `prompts_per_step` groups of `samples_per_prompt` Samples per step.

    Train splits are reshuffled every epoch (by `seed`); other splits keep file order,
    so an evaluation over `len(manager)` prompts covers each exactly once. Groups and
    samples are numbered in the order drawn (`group_id`, `uid`); the numbering is part of
    the position a checkpoint keeps."""

    def __init__(self, source: PromptSource, prompts_per_step: AtLeast1, samples_per_prompt: AtLeast1,
                 seed: int, split: str = "train"):
        self.problems: list[Problem] = source.problems(split)
        self.prompts_per_step = prompts_per_step
        self.samples_per_prompt = samples_per_prompt
        self.split = split
        self.seed = seed
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._next_group = 0
        self._next_uid = 0
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
            # same tokens whatever the order in which requests are issued or finish. Consecutive
            # within a group, so that its requests can go out as one (agents.single_turn.request_seed).
            first = hash((self.seed, gid)) & 0x7FFFFFFF
            groups.append([Sample(group_id=gid, prompt=p.messages, answer=p.answer, uid=self._next_uid + i,
                                  metadata=p.metadata | {"seed": first + i})
                           for i in range(self.samples_per_prompt)])
            self._next_uid += self.samples_per_prompt
        return groups

    def state_dict(self) -> dict:
        """The position in the data: shuffle state, epoch order, next group id and sample uid."""
        return {"rng": self._rng.getstate(), "order": list(self._order), "next_group": self._next_group,
                "next_uid": self._next_uid, "n_problems": len(self.problems)}

    def load_state_dict(self, state: dict) -> None:
        if state["n_problems"] != len(self.problems):
            raise ValueError(f"the {self.split} split has {len(self.problems)} prompts, the checkpoint "
                             f"was taken with {state['n_problems']}: the dataset changed")
        self._rng.setstate(state["rng"])
        self._order = list(state["order"])
        self._next_group, self._next_uid = state["next_group"], state["next_uid"]
