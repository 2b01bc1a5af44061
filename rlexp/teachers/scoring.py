"""Each completed sample scored by the teacher as it comes out of the agent, while the rest of
the batch is still generating: its tokens go to the teacher (one request per sample; the
teacher's engine or server batches the concurrent ones) and its `TeacherScores` come back on
the sample. Only the policy's own tokens keep a score (multi-turn and tool sessions: the
environment's and the tools' tokens are context, never trained).

With `align` (a teacher with another tokenizer) the sample's text is re-tokenized by the
teacher and its logprobs mapped onto the student's tokens (align.py). A teacher that fails
on a sample (TeacherError: unreachable, timed out, a malformed reply) fails that sample, with
the reason in its trace; the run counts it with the other failures (max_failure_fraction)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from rlexp.errors import TeacherError
from rlexp.protocols import Agent, Teacher
from rlexp.rollout.accounting import BusyMeter
from rlexp.sample import PromptLogprobs, Sample, Status, TeacherScores

if TYPE_CHECKING:
    from rlexp.teachers.align import Alignment


class TeacherScoring(Agent):
    """An Agent passing rollouts through to `agent`, its completed samples then scored by
    `teacher`; `aligner` (align mode): maps a teacher with another tokenizer (None: one
    vocabulary). `pop_metrics`: the teacher's time and tokens since the last call."""

    def __init__(self, agent: Agent, teacher: Teacher, aligner: Aligner | None = None):
        self.agent, self.teacher, self.aligner = agent, teacher, aligner
        self.busy = BusyMeter()  # seconds with a teacher request in flight, tokens scored
        self.failed = self.samples = self.aligned = self.trained = 0

    async def rollout(self, sample: Sample) -> Sample | list[Sample]:
        out = await self.agent.rollout(sample)
        done = [s for s in (out if isinstance(out, list) else [out])
                if s.status == Status.COMPLETED and s.response_length]
        await asyncio.gather(*(self.score(s) for s in done))
        return out

    async def score(self, sample: Sample) -> None:
        """Set `sample.teacher`, or fail the sample with the teacher's reason."""
        self.busy.enter()
        try:
            if self.aligner is None:
                scores = await self.teacher.score(sample.tokens)
                sample.teacher = own_tokens(scores, sample.loss_mask, self.teacher.top_k)
            else:
                alignment = self.aligner.align(sample.tokens)
                scores = await self.teacher.score(alignment.teacher_ids)
                sample.teacher, aligned, trained = self.aligner.on_student(alignment, scores,
                                                                           sample.loss_mask)
                self.aligned, self.trained = self.aligned + aligned, self.trained + trained
            self.samples += 1
        except TeacherError as e:
            self.failed += 1
            sample.status = Status.FAILED
            sample.metadata["error"] = f"teacher: {e}"
        finally:
            self.busy.exit()
            self.busy.tokens += len(sample.tokens)

    async def aclose(self) -> None:
        await self.agent.aclose()

    def pop_metrics(self) -> dict[str, float]:
        busy, tokens = self.busy.busy_s, self.busy.tokens
        out = {"teacher/busy_s": busy, "teacher/tokens": float(tokens), "teacher/failed": float(self.failed),
               "teacher/scored_samples": float(self.samples)}
        if busy > 0:
            out["teacher/tokens_per_s"] = tokens / busy
        if self.aligner is not None and self.trained:
            out["distill/aligned_frac"] = self.aligned / self.trained
        self.busy = BusyMeter()
        self.failed = self.samples = self.aligned = self.trained = 0
        return out


class Aligner:
    """The student's and the teacher's tokenizers (transformers'), for align mode (align.py)."""

    def __init__(self, student_tokenizer: Any, teacher_tokenizer: Any):
        self.student, self.teacher = student_tokenizer, teacher_tokenizer

    @classmethod
    def load(cls, student_path: str, teacher_path: str) -> Aligner:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(student_path), AutoTokenizer.from_pretrained(teacher_path))

    def align(self, student_ids: list[int]) -> Alignment:
        from rlexp.teachers.align import align

        return align(student_ids, self.student, self.teacher)

    def on_student(self, alignment: Alignment, scores: PromptLogprobs,
                   loss_mask: list[int]) -> tuple[TeacherScores, int, int]:
        from rlexp.teachers.align import scores_on_student

        return scores_on_student(alignment, scores, loss_mask)


def own_tokens(scores: PromptLogprobs, loss_mask: list[int], top_k: int) -> TeacherScores:
    """A teacher's scores of the student's own token ids as TeacherScores: entry t (t >= 1) is
    `scores.logprobs[t - 1]`, kept where the token is trained (loss_mask 1)."""
    n = len(loss_mask)
    if len(scores.logprobs) != n - 1:
        raise TeacherError(f"the teacher scored {len(scores.logprobs)} positions of {n} tokens "
                           f"(expected {n - 1})")
    logprobs = [0.0] + [lp if m else 0.0 for lp, m in zip(scores.logprobs, loss_mask[1:])]
    scored = [0] + list(loss_mask[1:])
    if not top_k:
        return TeacherScores(logprobs, scored)
    if scores.top is None or len(scores.top) != n - 1 or any(len(t) < top_k for t in scores.top):
        raise TeacherError(f"teacher.top_k={top_k}: the reply lacks the top-{top_k} ids at some position")
    ranked = [sorted(t.items(), key=lambda kv: -kv[1])[:top_k] for t in scores.top]
    top_ids = [[0] * top_k] + [[i for i, _ in r] for r in ranked]
    top_logprobs = [[0.0] * top_k] + [[lp for _, lp in r] for r in ranked]
    return TeacherScores(logprobs, scored, top_ids, top_logprobs)
