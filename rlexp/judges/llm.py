"""Judges that are models: a served chat model asked to grade (LLM-as-a-judge), a local
sequence-classification reward model, and the weighted sum that composes them with the
rule-based judges.

A model judge's calls never enter the training data: they go to the engine (or endpoint)
directly, not through an agent's session, so no sample holds their tokens. What it was asked
and answered is kept in the sample's `metadata["judge"]` (written to the trace files), and
its tokens are counted (`judge/tokens`, in the step's metrics)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from rlexp.chat.render import render_prompt
from rlexp.constraints import AtLeast1, NonNegative
from rlexp.protocols import Judge, RolloutEngine
from rlexp.sample import Constraint, Sample, SamplingConfig

DEFAULT_TEMPLATE = ("Grade the answer to the question from 0 (wrong) to 10 (right). Reply with the grade "
                    "only.\nQuestion: {question}\nReference answer: {answer}\nAnswer: {response}\nGrade:")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _question(sample: Sample) -> str:
    users = [m.get("content", "") for m in sample.prompt if m.get("role") == "user"]
    return users[-1] if users else ""


class LLMJudge(Judge):
    """reward = weight * (s - min_score) / (max_score - min_score), s the first number in the
    grader's reply to `template` (filled with {question}, {answer}: the reference, and
    {response}), clipped to [min_score, max_score]. The grader: the policy's own engine
    (`base_url` null; the run binds it), or any OpenAI-compatible endpoint (`base_url`,
    `model`, `api_key`). On the policy's engine the reply is constrained to `reply_regex`
    (guided decoding: a grade and nothing else; null: free text). A reply with no number
    raises: the guard fails the sample and the failure is counted."""

    # With `base_url` null and a `reply_regex`, grading asks the policy's engine for a
    # constrained reply: config.py then needs an engine that `constrains_replies`.
    constrains_policy_replies = True

    def __init__(self, template: str = DEFAULT_TEMPLATE, base_url: str | None = None, model: str = "policy",
                 api_key: str | None = None, min_score: float = 0.0, max_score: float = 10.0,
                 weight: float = 1.0, max_tokens: AtLeast1 = 8, temperature: NonNegative = 0.0,
                 reply_regex: str | None = r"[0-9]+(\.[0-9])?"):
        if max_score <= min_score:
            raise ValueError(f"max_score={max_score} must be > min_score={min_score}")
        self.template, self.base_url, self.model, self.api_key = template, base_url, model, api_key
        self.min_score, self.max_score, self.weight = min_score, max_score, weight
        self.sampling = SamplingConfig(temperature=temperature, max_tokens=max_tokens, seed=0,
                                       constraint=Constraint("regex", reply_regex) if reply_regex else None)
        self.engine: RolloutEngine | None = None
        self.tokenizer: Any = None
        self._client: Any = None

    def bind(self, engine: RolloutEngine, tokenizer: Any) -> None:
        """The run's engine and tokenizer: the grader when `base_url` is null."""
        self.engine, self.tokenizer = engine, tokenizer

    async def _ask(self, prompt: str) -> tuple[str, int]:
        """The grader's reply and its token count."""
        messages = [{"role": "user", "content": prompt}]
        if self.base_url is not None:
            if self._client is None:
                import openai

                self._client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "unused")
            r = await self._client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.sampling.max_tokens,
                temperature=self.sampling.temperature)  # an endpoint's reply is not constrained
            return r.choices[0].message.content or "", r.usage.completion_tokens if r.usage else 0
        if self.engine is None:
            raise RuntimeError("LLMJudge has no grader: give judge.base_url, or run it in rlexp's loop "
                               "(which binds the policy's engine)")
        gen = await self.engine.generate(render_prompt(self.tokenizer, messages), self.sampling)
        return self.tokenizer.decode(gen.token_ids, skip_special_tokens=True), len(gen.token_ids)

    async def score(self, sample: Sample) -> Sample:
        prompt = self.template.format(question=_question(sample), answer=sample.answer,
                                      response=sample.response_text)
        reply, tokens = await self._ask(prompt)
        sample.metadata["judge"] = {"prompt": prompt, "reply": reply}
        sample.metadata.setdefault("metrics", {})["judge/tokens"] = float(tokens)
        found = _NUMBER.search(reply)
        if found is None:
            raise ValueError(f"the grader's reply has no score: {reply[:80]!r}")
        s = min(max(float(found.group()), self.min_score), self.max_score)
        grade = (s - self.min_score) / (self.max_score - self.min_score)
        sample.reward_components = {"grade": grade}
        sample.reward = self.weight * grade
        return sample


class RewardModelJudge(Judge):
    """reward = weight * r (or sigmoid(r) with `sigmoid`), r the score a sequence-classification
    reward model (`model_path`, one label, run locally on the CPU or GPU) gives the prompt and
    the response, rendered with its tokenizer's chat template."""

    def __init__(self, model_path: str, weight: float = 1.0, sigmoid: bool = True,
                 max_length: AtLeast1 = 1024):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"{model_path}: a reward model has one label, this one has "
                             f"{self.model.config.num_labels}")
        self.weight, self.sigmoid, self.max_length = weight, sigmoid, max_length
        self._torch = torch
        self._lock = asyncio.Lock()  # one forward at a time: the model is shared

    def _reward(self, sample: Sample) -> float:
        messages = [*sample.prompt, {"role": "assistant", "content": sample.response_text}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        ids = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=self.max_length,
                             add_special_tokens=False)["input_ids"]
        with self._torch.no_grad():
            r = self.model(input_ids=ids).logits[0, 0].float()
        return float(self._torch.sigmoid(r) if self.sigmoid else r)

    async def score(self, sample: Sample) -> Sample:
        async with self._lock:
            r = await asyncio.to_thread(self._reward, sample)
        sample.reward_components = {"reward_model": r}
        sample.reward = self.weight * r
        return sample


class WeightedJudge(Judge):
    """reward = sum of weight_k * reward_k over the named judges (e.g. a rule and a grader);
    `reward_components` holds every judge's, as `<name>/<component>` and `<name>` (its
    reward); `correct` comes from the judge named `correct_from` (its own `correct`)."""

    def __init__(self, judges: dict[str, Judge], weights: dict[str, float] | None = None,
                 correct_from: str | None = None):
        weights = weights or {}
        unknown = set(weights) - set(judges) | ({correct_from} - set(judges) if correct_from else set())
        if unknown:
            raise ValueError(f"judge.weights / judge.correct_from name no judge: {sorted(unknown)} "
                             f"(the judges are {sorted(judges)})")
        self.judges, self.weights, self.correct_from = judges, weights, correct_from

    def bind(self, engine: RolloutEngine, tokenizer: Any) -> None:
        for judge in self.judges.values():
            judge.bind(engine, tokenizer)

    async def score(self, sample: Sample) -> Sample:
        components: dict[str, float] = {}
        total = 0.0
        for name, judge in self.judges.items():
            await judge.score(sample)  # each overwrites reward and components: read them now
            components |= {f"{name}/{k}": v for k, v in sample.reward_components.items()}
            components[name] = sample.reward
            total += self.weights.get(name, 1.0) * sample.reward
            if name == self.correct_from:
                components["correct"] = sample.reward_components.get("correct", float(sample.reward > 0))
        sample.reward_components, sample.reward = components, total
        return sample
