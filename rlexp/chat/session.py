"""Token-tracked chat sessions: every call's exact prompt and completion tokens, kept as a
tree of branches whose leaves become training Samples.

Turn N's prompt is the previous branch's full token sequence plus the tokens of only the
new messages: the chat is rendered as text, and the part after the branch's own decoded
text is tokenized and appended. If the rendering does not start with that text (the chat
template is not prefix-preserving, or the caller edited history), that is a *prefix break*:
it is counted, and the conversation continues from a fresh rendering, either as a separate
training sample (`on_prefix_break="split"`) or replacing the broken branch
(`on_prefix_break="restart"`: only the newest segment is trained).

Images (a vision-language model's; image parts in the messages) go the same way: the
rendering holds one placeholder per image, the new messages' tokens have each new image's
tokens expanded by the processor, and a branch is continued only if its images are the first
images of the new messages (by content), else the rendering is a prefix break too."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from rlexp.chat.images import ImagePrompts, image_key
from rlexp.chat.render import encode, render_chat
from rlexp.chat.tool_prompt import ToolPath
from rlexp.errors import SessionError
from rlexp.messages import split_images
from rlexp.sample import Generation, Sample, Status, TokenTrace

PrefixBreak = Literal["split", "restart"]


@dataclass
class Branch:
    """One path through a conversation: its token trace and the text it decodes to."""

    trace: TokenTrace = field(default_factory=TokenTrace)
    text: str = ""  # decode(trace.tokens), to match the next rendering against
    finish_reason: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)  # as last sent by the caller
    images: list[Any] = field(default_factory=list)  # PIL images, one per image in the tokens
    image_keys: list[str] = field(default_factory=list)  # their `image_key`s
    open: bool = True  # False once extended by a later turn (then it is not a leaf)
    segment: int = 0
    # Set by `prepare` on a prompt, applied by `record`: a request that fails in between
    # (too long, rejected by the engine) leaves the session as it was.
    parent: Branch | None = None  # the branch this prompt extends
    breaks_prefix: bool = False  # no branch's text is a prefix of this prompt's

    def copy(self) -> Branch:
        """A copy of the trace (cheap); messages are never mutated in place."""
        return dataclasses.replace(self, trace=self.trace.copy(), messages=list(self.messages),
                                   images=list(self.images), image_keys=list(self.image_keys))


class ChatSession:
    """All branches of one conversation (one task attempt)."""

    def __init__(self, tokenizer, max_context: int, on_prefix_break: PrefixBreak = "split",
                 tool_prompt: ToolPath = "template", image_prompts: ImagePrompts | None = None):
        self.tokenizer = tokenizer
        self.image_prompts = image_prompts or ImagePrompts(tokenizer)
        self.max_context = max_context
        self.on_prefix_break = on_prefix_break
        self.tool_prompt = tool_prompt
        self.branches: list[Branch] = []
        self.prefix_breaks = 0
        self.calls = 0

    # ---- building prompts -------------------------------------------------------------
    def render(self, messages: list[dict[str, Any]], tools: list | None = None) -> str:
        return render_chat(self.tokenizer, messages, tools, tool_prompt=self.tool_prompt)

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def prepare(self, messages: list[dict[str, Any]], tools: list | None = None) -> Branch:
        """The branch to continue for `messages`, with the new prompt tokens appended. The
        session itself changes only when a completion of it is recorded."""
        if not messages:
            raise SessionError("messages must be a non-empty list", param="messages")
        bare, images = split_images(messages)
        if images:
            self.image_prompts.check()  # a model that takes images
        keys = [image_key(im) for im in images]
        rendered = self.render(bare, tools)
        parent = self._match(rendered, keys)
        if parent is None:
            segment = 1 + max(b.segment for b in self.branches) if self.branches else 0
            branch = Branch(segment=segment, breaks_prefix=bool(self.branches))
            branch.trace.append(self._encode(rendered, images), role="prompt", text=rendered)
        else:
            branch = parent.copy()
            branch.open, branch.parent = True, parent
            suffix = rendered[len(parent.text):]
            branch.trace.append(self._encode(suffix, images[len(parent.images):]),
                                role=messages[-1].get("role", ""), text=suffix)
        branch.text, branch.images, branch.image_keys = rendered, images, keys
        branch.messages = list(messages)
        if len(branch.trace) >= self.max_context:
            raise SessionError(f"prompt has {len(branch.trace)} tokens; the context is "
                               f"{self.max_context}", param="messages")
        return branch

    def _encode(self, text: str, images: list[Any]) -> list[int]:
        return self.image_prompts.encode(text, images) if images else self.encode(text)

    def _match(self, rendered: str, image_keys: list[str]) -> Branch | None:
        """The longest branch whose text the new rendering extends, with the new messages'
        first images (an already extended branch matches too: continuing it again forks the
        conversation)."""
        best = None
        for b in self.branches:
            if rendered.startswith(b.text) and image_keys[:len(b.image_keys)] == b.image_keys \
                    and (best is None or len(b.text) > len(best.text)):
                best = b
        return best

    # ---- recording completions ---------------------------------------------------------
    def record(self, prompt: Branch, gen: Generation, requested: dict[str, Any] | None = None) -> Branch:
        """Add one completion of `prompt` as a new open branch (n > 1: call once per choice).
        `requested`: what the request asked of the sampling beyond the defaults (a constraint,
        penalties, ...), kept in the reply's turn record so the training data shows it."""
        if prompt.parent is not None:  # it is continued, so no longer a leaf
            prompt.parent.open = False
        if prompt.breaks_prefix:  # history exists but the rendering does not extend it
            self.prefix_breaks += 1
            if self.on_prefix_break == "restart":
                self.branches.clear()
        prompt.parent, prompt.breaks_prefix = None, False
        branch = prompt.copy()
        text = self.tokenizer.decode(gen.token_ids, skip_special_tokens=False)
        branch.trace.append(gen.token_ids, role="assistant", text=text, generation=gen)
        if requested:
            branch.trace.turns[-1]["sampling"] = requested
        branch.text = prompt.text + text
        branch.finish_reason = gen.finish_reason
        branch.open = True
        self.branches.append(branch)
        self.calls += 1
        return branch

    # ---- stitching ----------------------------------------------------------------------
    def leaves(self) -> list[Branch]:
        """Branches nobody continued and that hold policy tokens: one training sample each."""
        return [b for b in self.branches if b.open and any(b.trace.loss_mask)]

    def newest(self, template: Sample) -> Sample:
        """The newest completion's branch as a Sample, for a judge to score mid-conversation.
        A copy: `template` and the session are left as they are."""
        s = copy.copy(template)
        s.metadata, s.reward_components = dict(template.metadata), {}
        _fill(s, self.branches[-1])
        return s

    def to_samples(self, template: Sample) -> list[Sample]:
        """One Sample per leaf; leaves share their common prefix tokens."""
        out = []
        for i, leaf in enumerate(self.leaves()):
            s = copy.copy(template) if i else template
            s.metadata = dict(template.metadata) | {"branch": i, "segment": leaf.segment,
                                                     "prefix_breaks": self.prefix_breaks}
            _fill(s, leaf)
            if leaf.images:  # for the engine and, as pixel inputs, for the trainer
                s.mm_infer_info = self.image_prompts.infer_info(leaf.images, leaf.trace.tokens)
                s.mm_train_info = self.image_prompts.train_info(leaf.images)
            s.metadata["truncated"] = leaf.finish_reason == "length"
            s.metadata["messages"] = leaf.messages
            s.metadata["metrics"] = {
                "multiturn/turns_mean": float(sum(t["mask"] for t in leaf.trace.turns)),
                # counted once per session, on its first sample
                "multiturn/prefix_breaks": float(self.prefix_breaks if i == 0 else 0)}
            s.status = Status.COMPLETED
            out.append(s)
        return out


def _fill(sample: Sample, branch: Branch) -> None:
    """The branch's tokens, how it ended, and its last reply as the response."""
    sample.trace, sample.finish_reason = branch.trace, branch.finish_reason
    sample.response_text = next((t["text"] for t in reversed(branch.trace.turns) if t["mask"]), "")
