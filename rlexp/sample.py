"""The one record that flows through rlexp: a Sample and its lifecycle Status."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any


class Status(str, enum.Enum):
    INIT = "init"
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"
    FILTERED = "filtered"
    ARCHIVED = "archived"


@dataclass
class SamplingConfig:
    """Sampling settings handed to a RolloutEngine; engine-agnostic."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    regex: str | None = None  # constrain the output to this pattern (e.g. tool_choice="required")


@dataclass
class Generation:
    """What a RolloutEngine returns for one prompt: token-in/token-out."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" | "length" | "abort"
    versions: list[int]  # per token: policy version of the engine weights that produced it

    @property
    def version(self) -> int:
        """The oldest policy version among the tokens (the engine's version if there are none)."""
        return min(self.versions, default=-1)


_uids = itertools.count()


def uid_counter() -> int:
    """The next Sample uid; a resumed run continues the numbering (uids stay unique per run)."""
    global _uids
    n = next(_uids)
    _uids = itertools.count(n)
    return n


def set_uid_counter(n: int) -> None:
    global _uids
    _uids = itertools.count(n)


@dataclass
class Sample:
    """One trajectory. `tokens` is the full sequence (prompt + response); `loss_mask`,
    `logprobs` and `versions` are aligned to it (0 / 0.0 / -1 on non-policy tokens)."""

    group_id: int
    prompt: list[dict[str, str]]  # chat messages
    answer: str  # reference answer for the judge
    prompt_token_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    response_text: str = ""
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    status: Status = Status.INIT
    turns: list[dict[str, Any]] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def response_length(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        policy = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(policy) if policy else -1

    @property
    def error(self) -> str | None:
        """Why this sample failed or was cut off (an agent or judge fault), if it did."""
        return self.metadata.get("error")

    def staleness(self, trained_version: int) -> int:
        """THE definition of staleness: the number of policy versions between the version that
        generated this sample's oldest trained token and the version being trained."""
        return trained_version - self.oldest_version if self.response_length else 0

    def to_trace(self, decode) -> dict[str, Any]:
        """One JSON-serialisable line of the rollout trace artifact."""
        return {
            "uid": self.uid,
            "group_id": self.group_id,
            "prompt": self.prompt,
            "response": self.response_text,
            "answer": self.answer,
            "reward": self.reward,
            "reward_components": self.reward_components,
            "status": self.status.value,
            "finish_reason": self.finish_reason,
            "policy_version": self.oldest_version,
            "token_ids": self.tokens,
            "loss_mask": self.loss_mask,
            "logprobs": [round(x, 6) for x in self.logprobs],
            "versions": self.versions,
            "turns": self.turns,
            "error": self.error,
            "text": decode(self.tokens),
        }
