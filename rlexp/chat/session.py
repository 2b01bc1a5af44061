"""Token-tracked chat sessions: every call's exact prompt and completion tokens, kept as a
tree of branches whose leaves become training Samples.

Turn N's prompt is the previous branch's full token sequence plus the tokens of only the
new messages: the chat is rendered as text, and the part after the branch's own decoded
text is tokenized and appended. If the rendering does not start with that text (the chat
template is not prefix-preserving, or the caller edited history), that is a *prefix break*:
it is counted, and the conversation continues from a fresh rendering, either as a separate
training sample (`on_prefix_break="split"`) or replacing the broken branch
(`on_prefix_break="restart"`: only the newest segment is trained)."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlexp.sample import Generation, Sample, Status


@dataclass
class Branch:
    """One path through a conversation: tokens with their mask, logprobs and versions."""

    tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""  # decode(tokens), to match the next rendering against
    turns: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)  # as last sent by the caller
    open: bool = True  # False once extended by a later turn (then it is not a leaf)
    segment: int = 0

    def copy(self) -> Branch:
        """Copies of the token lists (cheap); turns and messages are never mutated in place."""
        return dataclasses.replace(self, tokens=list(self.tokens), loss_mask=list(self.loss_mask),
                                   logprobs=list(self.logprobs), versions=list(self.versions),
                                   turns=list(self.turns), messages=list(self.messages))

    def append(self, ids: list[int], *, policy: bool, logprobs: list[float] | None = None,
               versions: list[int] | None = None, role: str = "", text: str = "") -> None:
        start = len(self.tokens)
        self.tokens += ids
        self.loss_mask += [int(policy)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += versions if versions is not None else [-1] * len(ids)
        self.turns.append({"role": role, "text": text, "span": [start, len(self.tokens)],
                           "mask": int(policy)})


class SessionError(ValueError):
    """A request the session cannot serve (bad messages, unknown session, too long)."""


class ChatSession:
    """All branches of one conversation (one task attempt)."""

    def __init__(self, tokenizer, max_context: int, on_prefix_break: str = "split"):
        if on_prefix_break not in ("split", "restart"):
            raise ValueError(f"on_prefix_break must be 'split' or 'restart', got {on_prefix_break!r}")
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.on_prefix_break = on_prefix_break
        self.branches: list[Branch] = []
        self.prefix_breaks = 0
        self.calls = 0

    # ---- building prompts -------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list | None = None) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False, **kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prepare(self, messages: list[dict[str, Any]], tools: list | None = None) -> Branch:
        """The branch to continue for `messages`, with the new prompt tokens appended."""
        if not messages:
            raise SessionError("messages must be a non-empty list")
        rendered = self.render(messages, tools)
        parent = self._match(rendered)
        if parent is None:
            segment = 0
            if self.branches:  # history exists but the rendering does not extend it
                self.prefix_breaks += 1
                segment = 1 + max(b.segment for b in self.branches)
                if self.on_prefix_break == "restart":
                    self.branches.clear()
            branch = Branch(segment=segment)
            branch.append(self.encode(rendered), policy=False, role="prompt", text=rendered)
        else:
            parent.open = False
            branch = parent.copy()
            branch.open = True
            suffix = rendered[len(parent.text):]
            branch.append(self.encode(suffix), policy=False, role=messages[-1].get("role", ""),
                          text=suffix)
        branch.text = rendered
        branch.messages = list(messages)
        if len(branch.tokens) >= self.max_context:
            raise SessionError(f"prompt has {len(branch.tokens)} tokens; the context is "
                               f"{self.max_context}")
        return branch

    def _match(self, rendered: str) -> Branch | None:
        """The longest branch whose text the new rendering extends (an already extended
        branch matches too: continuing it again forks the conversation)."""
        best = None
        for b in self.branches:
            if rendered.startswith(b.text) and (best is None or len(b.text) > len(best.text)):
                best = b
        return best

    # ---- recording completions ---------------------------------------------------------
    def record(self, prompt: Branch, gen: Generation) -> Branch:
        """Add one completion of `prompt` as a new open branch (n > 1: call once per choice)."""
        branch = prompt.copy()
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        branch.append(gen.token_ids, policy=True, logprobs=gen.logprobs, versions=gen.versions,
                      role="assistant", text=text)
        branch.text = prompt.text + text
        branch.finish_reason = gen.finish_reason
        branch.open = True
        self.branches.append(branch)
        self.calls += 1
        return branch

    # ---- stitching ----------------------------------------------------------------------
    def leaves(self) -> list[Branch]:
        """Branches nobody continued and that hold policy tokens: one training sample each."""
        return [b for b in self.branches if b.open and any(b.loss_mask)]

    def to_samples(self, template: Sample) -> list[Sample]:
        """One Sample per leaf; leaves share their common prefix tokens."""
        out = []
        for i, leaf in enumerate(self.leaves()):
            s = copy.copy(template) if i else template
            s.metadata = dict(template.metadata) | {"branch": i, "segment": leaf.segment,
                                                     "prefix_breaks": self.prefix_breaks}
            first_policy = leaf.loss_mask.index(1)
            s.prompt_token_ids = leaf.tokens[:first_policy]
            s.tokens, s.loss_mask = leaf.tokens, leaf.loss_mask
            s.logprobs, s.versions = leaf.logprobs, leaf.versions
            s.turns, s.finish_reason = leaf.turns, leaf.finish_reason
            s.metadata["truncated"] = leaf.finish_reason == "length"
            s.metadata["messages"] = leaf.messages
            s.response_text = next((t["text"] for t in reversed(leaf.turns) if t["mask"]), "")
            s.metadata["metrics"] = {
                "multiturn/turns_mean": float(sum(t["mask"] for t in leaf.turns)),
                # counted once per session, on its first sample
                "multiturn/prefix_breaks": float(self.prefix_breaks if i == 0 else 0)}
            s.status = Status.COMPLETED
            out.append(s)
        return out
