"""The one record that flows through rlexp: a Sample and its lifecycle Status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from rlexp.constraints import AtLeast1, NonNegative, TopP
from rlexp.messages import jsonable_messages, trace_metadata

T = TypeVar("T")


class Status(str, enum.Enum):
    INIT = "init"
    COMPLETED = "completed"
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"
    FILTERED = "filtered"


@dataclass(frozen=True)
class Constraint:
    """What a reply must match, enforced by the engine's guided decoding: a `regex`, a JSON
    schema (`json_schema`, `spec` is the schema as JSON text) or any JSON object."""

    kind: Literal["regex", "json_schema", "json_object"]
    spec: str = ""


@dataclass
class SamplingConfig:
    """Sampling settings handed to a RolloutEngine; engine-agnostic. The fields after `seed`
    come from requests to the OpenAI-compatible server (rlexp/chat/schema.py)."""

    temperature: NonNegative = 1.0  # 0 = greedy
    top_p: TopP = 1.0
    max_tokens: AtLeast1 = 16
    seed: int | None = None
    constraint: Constraint | None = None  # e.g. tool_choice="required", response_format
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per earlier occurrence in the reply
    presence_penalty: float = 0.0  # OpenAI's: subtracted once a token occurred in the reply
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    top_logprobs: int = 0  # alternatives per generated token to return with their logprobs
    # From the Tinker API's SamplingParams (rlexp/tinker/sampler.py):
    top_k: int = 0  # sample among the k likeliest tokens only (0: all)
    stop: tuple[str, ...] = ()  # text that ends the reply (then detokenized as it goes)
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the reply (kept in it), besides EOS
    ignore_eos: bool = False  # EOS does not end the reply
    # Which weights answer: a LoRA adapter the engine serves by this name (a Tinker tenant's;
    # rlexp/rollout/vllm_adapters.py), None for the engine's policy.
    adapter: str | None = None

    def __post_init__(self) -> None:  # tuples, whatever the config gave (Hydra passes lists): hashable
        self.stop, self.stop_token_ids = tuple(self.stop), tuple(self.stop_token_ids)

    @property
    def depends_on_the_reply(self) -> bool:
        """The distribution of a token depends on the reply so far (a grammar's state, the
        penalties' counts): a reply cut short cannot go on as a new request from its tokens."""
        return self.constraint is not None or bool(self.frequency_penalty or self.presence_penalty)

    def requested(self) -> dict[str, Any]:
        """The request-level fields set away from their defaults, for a reply's record."""
        out: dict[str, Any] = {}
        if self.constraint is not None:
            out["constraint"] = {"kind": self.constraint.kind, "spec": self.constraint.spec}
        for name in ("frequency_penalty", "presence_penalty", "logit_bias", "top_logprobs", "adapter"):
            if getattr(self, name):
                out[name] = getattr(self, name)
        return out


RESHAPING = ("constraint", "frequency_penalty", "presence_penalty", "logit_bias")  # requested() keys


def reshapes(requested: dict[str, Any]) -> bool:
    """A request's settings (`SamplingConfig.requested()`) make the sampling distribution other
    than the model's at the run's temperature: the engine's logprobs are of that distribution,
    which the trainer's forward does not compute (guided decoding masks the logits first)."""
    return any(k in requested for k in RESHAPING)


@dataclass
class Generation:
    """What a RolloutEngine returns for one prompt: token-in/token-out."""

    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the sampling distribution
    finish_reason: str  # "stop" | "length" | "abort"
    versions: list[int]  # per token: policy version of the engine weights that produced it
    top_logprobs: list[dict[int, float]] | None = None  # per token, when asked: the likeliest ids
    # MoE, with rollout.routing_capture: the experts each layer chose at each position the
    # engine computed, a numpy integer array [prompt + generated - 1, layers, k]
    routed_experts: Any = None
    # An in-flight weight update (update_mode=keep): the tokens from `mixed_from` on were
    # produced by newer weights over KV that version `context_version` wrote (None: none were)
    mixed_from: int | None = None
    context_version: int | None = None

    @property
    def version(self) -> int:
        """The oldest policy version among the tokens (the engine's version if there are none)."""
        return min(self.versions, default=-1)


@dataclass(frozen=True)
class PromptLogprobs:
    """A model's scores of a token sequence of n tokens: `logprobs[i]` is log p(token i + 1 |
    tokens 0 .. i), n - 1 entries; `top` (when asked): the likeliest ids at each of those
    positions with their logprobs."""

    logprobs: list[float]
    top: list[dict[int, float]] | None = None


@dataclass
class TeacherScores:
    """A teacher's scores of a sample's tokens, aligned with them (entry t is of token t):
    `logprobs[t]` log p_teacher(token t | the tokens before), `scored[t]` 1 where that entry is
    the teacher's (a trained token the teacher scored; with different tokenizers, one aligned
    through the text), else 0 and the entry is 0.0. `top_ids` / `top_logprobs` (teacher.top_k >
    0, one tokenizer): the teacher's likeliest ids at the position that predicts token t."""

    logprobs: list[float]
    scored: list[int]
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def stitch_routing(before: Any, after: Any) -> Any:
    """THE rule for a position's routing: the engine's choice when it first computed that
    position. `before` covers positions 0 .. len(before) - 1 (an earlier request: a turn, or
    a completion cut by a weight update); `after` (a later request over the same tokens and
    more) adds the positions past them. numpy arrays [positions, layers, k]."""
    if before is None or after is None:
        return after if before is None else before
    import numpy as np

    return np.concatenate([before, after[len(before):]]) if len(after) > len(before) else before


def staleness(trained_version: int, generated_version: int) -> int:
    """THE definition of staleness: the number of policy versions between the version that
    generated a token and the version being trained."""
    return trained_version - generated_version


@dataclass
class TokenTrace:
    """A token sequence and what is known of each token, kept aligned by `append`:
    `loss_mask` 1 = produced by the policy (trained), 0 = prompt / environment / tool text;
    `logprobs` the policy's sampling logprob (0.0 elsewhere); `versions` the policy version
    that produced it (-1 elsewhere). `turns` records each appended span."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[dict[str, Any]] = field(default_factory=list)
    # MoE (rollout.routing_capture): the engine's experts per position, numpy [positions,
    # layers, k], for positions 0 .. len - 2 as far as generations covered them
    routed_experts: Any = None

    def append(self, ids: list[int], *, role: str, text: str = "",
               generation: Generation | None = None) -> None:
        """Add `ids`: the policy's (with the `generation` they came from) or, without one,
        text it did not produce."""
        start = len(self.tokens)
        self.tokens += ids
        self.loss_mask += [int(generation is not None)] * len(ids)
        self.logprobs += generation.logprobs if generation is not None else [0.0] * len(ids)
        self.versions += generation.versions if generation is not None else [-1] * len(ids)
        turn = {"role": role, "text": text, "span": [start, len(self.tokens)],
                "mask": int(generation is not None)}
        if generation is not None and generation.mixed_from is not None:  # across an in-flight update
            turn |= {"mixed_from": start + generation.mixed_from,
                     "context_version": generation.context_version}
        self.turns.append(turn)
        if generation is not None and generation.routed_experts is not None:
            self.routed_experts = stitch_routing(self.routed_experts, generation.routed_experts)

    def model_sampled(self) -> list[int]:
        """Per token 1, or 0 in a turn whose request reshaped the distribution (`reshapes`) and
        from a turn's `mixed_from` on (tokens of newer weights over KV older ones wrote, after an
        in-flight update): where the engine's logprob is one version's own, for the weight-sync
        check to compare."""
        out = [1] * len(self.tokens)
        for turn in self.turns:
            start, end = turn["span"]
            if reshapes(turn.get("sampling", {})):
                out[start:end] = [0] * (end - start)
            elif "mixed_from" in turn:
                out[turn["mixed_from"]:end] = [0] * (end - turn["mixed_from"])
        return out

    def mixed_tokens(self) -> int:
        """Tokens whose context holds KV written by older weights than their own (`mixed_from`)."""
        return sum(t["span"][1] - t["mixed_from"] for t in self.turns if "mixed_from" in t)

    def copy(self) -> TokenTrace:
        """Copies of the lists (cheap); the turn records and routing arrays are never mutated
        in place."""
        return TokenTrace(list(self.tokens), list(self.loss_mask), list(self.logprobs),
                          list(self.versions), list(self.turns), self.routed_experts)

    def __len__(self) -> int:
        return len(self.tokens)


class _FromTrace(Generic[T]):
    """`sample.tokens` reads `sample.trace.tokens` (and so on)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, sample: Sample | None, owner: type | None = None) -> T:
        if sample is None:
            raise AttributeError(f"{self.name} is read from a Sample, not from the class")
        return getattr(sample.trace, self.name)


@dataclass
class Sample:
    """One trajectory: its prompt, its `trace` (prompt + response tokens, aligned per token)
    and what the judge made of it."""

    group_id: int
    prompt: list[dict[str, str]]  # chat messages
    answer: str  # reference answer for the judge
    trace: TokenTrace = field(default_factory=TokenTrace)
    response_text: str = ""
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    status: Status = Status.INIT
    metadata: dict[str, Any] = field(default_factory=dict)
    uid: int = -1  # numbered by the DataManager that drew it (unique in its split); -1: made by hand
    # A vision-language model's images, in the order their tokens sit in the trace. What the
    # engine takes (`images`: PIL images) and what the trainer's forward takes (the processor's
    # `pixel_values` [images, 3, H, W] and `pixel_attention_mask` [images, H, W]).
    mm_infer_info: dict[str, Any] | None = None
    mm_train_info: dict[str, Any] | None = None
    teacher: TeacherScores | None = None  # on-policy distillation: the teacher's per-token scores

    # Read-only views of the trace's lists (the trace alone writes them).
    tokens = _FromTrace[list[int]]("tokens")
    loss_mask = _FromTrace[list[int]]("loss_mask")
    logprobs = _FromTrace[list[float]]("logprobs")
    versions = _FromTrace[list[int]]("versions")
    turns = _FromTrace[list[dict[str, Any]]]("turns")

    @property
    def response_length(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among the trained tokens and the KV they attended to (a
        turn's `context_version`, where an in-flight update mixed them)."""
        policy = [v for v, m in zip(self.versions, self.loss_mask) if m]
        policy += [t["context_version"] for t in self.turns if t.get("mask") and "context_version" in t]
        return min(policy) if policy else -1

    @property
    def correct(self) -> float:
        """THE definition of a correct answer (1.0 or 0.0): the judge's `correct` reward
        component, else (an agent that returned its own reward) whether the reward is positive."""
        return self.reward_components.get("correct", float(self.reward > 0))

    @property
    def error(self) -> str | None:
        """Why this sample failed or was cut off (an agent or judge fault), if it did."""
        return self.metadata.get("error")

    def staleness(self, trained_version: int) -> int:
        """`staleness` of the sample's oldest trained token (0 without trained tokens)."""
        return staleness(trained_version, self.oldest_version) if self.response_length else 0

    def token_staleness(self, trained_version: int) -> list[int]:
        """`staleness` of every token (prompt tokens, version -1, are masked out of training)."""
        return [staleness(trained_version, v) for v in self.versions]

    def to_trace(self, decode) -> dict[str, Any]:
        """One JSON-serialisable line of the rollout trace artifact."""
        return {
            "uid": self.uid,
            "group_id": self.group_id,
            "prompt": jsonable_messages(self.prompt),
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
            "teacher_logprobs": None if self.teacher is None else [
                round(x, 6) if m else None for x, m in zip(self.teacher.logprobs, self.teacher.scored)],
            "versions": self.versions,
            "turns": self.turns,
            "judge": self.metadata.get("judge"),  # a model judge's prompt and reply
            "error": self.error,
            "metadata": trace_metadata(self.metadata),
            "text": decode(self.tokens),
        }
