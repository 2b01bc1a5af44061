"""Every seam of rlexp on one page. Components are held by these types; any class with the
same members fits. What a component can do is a method or a declared attribute here, never
probed with `hasattr`: an optional one has a default (a body, a value), which a class gets by
subclassing the Protocol (`class MyJudge(Judge)`; rlexp's own judges do) or writes itself. The
config check reads the declared attributes from the `_target_` classes before anything is
built (rlexp/config_components.py).

    RLLoop (rlexp/loop.py) owns the policy version, the step and the checkpoint directory
      |-- Scheduler      produce_batch(data, agent, version) / sync_weights(engine, publish, version)
      |     '-- Agent    rollout(sample) -> Sample(s), talking to the RolloutEngine, scored by a Judge
      |-- Trainer        fit(batch, version); weights() for publication; save(dir) / load(dir)
      |                  (rlexp's TrainController: fit is rlexp/trainer/update.py's stages)
      |-- WeightTransport  trainer.weights() -> engine, tagged with the version they become
      |                  (rlexp/weights/protocols.py, with what a transport asks of an engine)
      |-- Teacher        score(tokens) -> its logprob of each token (on-policy distillation)
      |-- Evaluator      metrics(eval batch)
      '-- Tracker        params, metrics, traces (MLflow)
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlexp.rollout.each import generate_each

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from rlexp.constraints import UpdateMode
    from rlexp.data.manager import DataManager
    from rlexp.rollout.accounting import BusyMeter
    from rlexp.sample import Generation, PromptLogprobs, Sample, SamplingConfig

class RolloutEngine(Protocol):
    """Token ids in; token ids and the logprobs they were sampled with out."""

    version: int  # policy version of the weights loaded now (the loop's number, never counted here)
    sampling: SamplingConfig  # the run's default (training) sampling settings
    max_model_len: int  # prompt + response tokens one request may hold
    busy: BusyMeter  # seconds with at least one request in flight, tokens generated
    # What the class can do, read from the `rollout._target_` class before anything is built:
    takes_images: bool = False  # `generate(images=...)`: a vision-language model's pictures
    constrains_replies: bool = False  # applies `SamplingConfig.constraint` (guided decoding)
    update_modes: tuple[str, ...] = ("abort", "wait")  # what `pause` can do (scheduler.update_mode)
    serves_adapters: bool = False  # `load_adapter`: LoRA adapters on its base (weight_transfer=lora_adapter)

    async def generate(self, token_ids: list[int], sampling: SamplingConfig,
                       images: list[Any] | None = None) -> Generation:
        """One completion; every token carries the version of the weights that produced it.
        `images`: a vision-language model's, one per image in `token_ids` (expanded there)."""
        ...

    async def generate_streaming(self, token_ids: list[int], sampling: SamplingConfig,
                                 on_tokens: Callable[[list[int], list[float]], None] | None,
                                 images: list[Any] | None = None) -> Generation:
        """`generate`, calling `on_tokens(ids, logprobs)` with new tokens as they come (the
        server's `stream=true`; rlexp/chat/streaming.py). The default, for an engine that
        cannot stream, reports the whole reply once, when it is done."""
        gen = await self.generate(token_ids, sampling, images)
        if on_tokens is not None and gen.token_ids:
            on_tokens(gen.token_ids, gen.logprobs)
        return gen

    async def generate_group(self, token_ids: list[int], samplings: list[SamplingConfig]) -> list[Generation]:
        """One completion of `token_ids` per entry of `samplings` (a prompt group's samples, each
        with its own seed), each the one `generate` gives it. The default calls `generate` for
        each, concurrently; an engine that can send them as one request does (VLLMEngine)."""
        return await generate_each(self, token_ids, samplings)

    async def pause(self, mode: UpdateMode) -> None:
        """Stop starting new work before a weight update. `mode`: "wait" until every in-flight
        request finished; "abort" cuts them short now, each continuing from its tokens under
        the new weights after `resume` (prompt and tokens prefilled again); "keep" freezes them
        with their KV cache, to go on under the new weights after `resume` with nothing
        prefilled again (an engine without it lacks "keep" in `update_modes`). Every token
        keeps the version that produced it."""
        ...

    async def resume(self) -> None: ...

    async def sleep(self) -> None:
        """Release accelerator memory while the trainer trains (a no-op where nothing to free)."""
        ...

    async def wake_up(self) -> None: ...

    def pop_replica_metrics(self) -> dict[str, float]:
        """The engine's own metrics since the last call, logged with the step: per replica for
        a pool of them (cluster=ray), none for one engine."""
        ...

    def shutdown(self) -> None: ...


class Tool(Protocol):
    """A function the policy may call (rlexp/tools/): an OpenAI tool `spec`, and the call."""

    spec: dict[str, Any]
    reads_images: bool = False  # True: an `ImageTool`, called with the conversation's images

    async def __call__(self, arguments: str) -> str | list[dict[str, Any]]:
        """`arguments`: the call's JSON object; returns the result text (or "error: ..."), or
        content parts (text and image parts, for a vision-language model)."""
        ...


class ImageTool(Protocol):
    """A tool that reads the conversation's pictures (`reads_images = True`; rlexp/tools/zoom.py)."""

    spec: dict[str, Any]
    reads_images: bool

    async def __call__(self, arguments: str, images: Sequence[Any] = ()) -> str | list[dict[str, Any]]:
        """As `Tool`'s, with `images`: the conversation's images so far, in order."""
        ...


class Judge(Protocol):
    # may grade on the policy's engine with its reply constrained (judge=llm): the config
    # check then needs a rollout engine that `constrains_replies`
    constrains_policy_replies: bool = False

    async def score(self, sample: Sample) -> Sample:
        """Set `reward` and `reward_components`, with `correct` (1.0 or 0.0) among them where
        the judge decides correctness (`Sample.correct` reads it; agents ask a judge, never
        decide it themselves)."""
        ...

    def bind(self, engine: RolloutEngine, tokenizer: Any) -> None:
        """Optional: the run's engine and tokenizer, given once before any rollout, for a
        judge that grades with the policy's engine (judge=llm with `base_url` null). The
        default, inherited by subclassing `Judge`, keeps nothing."""
        return None


class Agent(Protocol):
    sends_images: bool = False  # a prompt's images reach the engine (checked for data with images)
    rolls_out_groups: bool = False  # has a `rollout_group` of its own (schedulers call it then)

    async def rollout(self, sample: Sample) -> Sample | list[Sample]:
        """One trajectory from the sample's prompt (several if the conversation branched or
        was split at a prefix break), scored by the agent's judge."""
        ...

    async def rollout_group(self, samples: list[Sample]) -> list[Sample | list[Sample] | BaseException]:
        """`rollout` of each sample of a prompt group, in order, an exception standing for a
        rollout that raised one. The default runs `rollout` per sample, concurrently; an agent
        that does the group's work once (`rolls_out_groups`) gives the same samples."""
        return list(await asyncio.gather(*(self.rollout(s) for s in samples), return_exceptions=True))

    async def aclose(self) -> None: ...


class Teacher(Protocol):
    """A model that scores token sequences (on-policy distillation: the student samples, the
    teacher scores the student's tokens; rlexp/teachers/)."""

    top_k: int  # besides each token's own logprob, the teacher's top_k likeliest ids per position
    tokenizer_path: str | None  # the directory of the tokenizer its ids are of (None: the student's)
    align: bool  # another tokenizer than the student's: its scores are mapped through the text (align.py)

    async def score(self, token_ids: list[int]) -> PromptLogprobs:
        """log p(token_ids[i] | token_ids[:i]) for i = 1 .. n - 1 (and the top_k per position).
        Raises TeacherError when the teacher cannot answer or its reply is malformed."""
        ...

    def shutdown(self) -> None: ...


class Scheduler(Protocol):
    overlaps_training: bool = False  # generates while the trainer trains (no engine sleep then)

    @property
    def max_staleness(self) -> int:
        """The most versions a trained token may be older than the version it trains."""
        ...

    async def produce_batch(self, data: DataManager, agent: Agent, version: int) -> list[Sample]:
        """The next batch to train policy `version` on."""
        ...

    async def sync_weights(self, engine: RolloutEngine, publish: Callable[[], Awaitable[None]],
                           version: int) -> None:
        """Run `publish` (the engine then serves `version`) at a moment the engine allows."""
        ...

    def pop_counts(self) -> dict[str, float]:
        """Samples rejected and tokens generated but never trained, since the last call."""
        ...

    def evaluating(self) -> AbstractAsyncContextManager[None]:
        """Entered while the held-out split is evaluated: evaluation has the engine first."""
        ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    async def aclose(self) -> None: ...


class Trainer(Protocol):
    def fit(self, batch: list[Sample], version: int) -> dict[str, float]:
        """One update of policy `version` (the version being trained) on `batch`."""
        ...

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy's full tensors by name, for publication to the rollout engine: every tensor
        that can have changed (a frozen vision encoder's are left out; the engine keeps its own)."""
        ...

    def save(self, directory: Path) -> None:
        """Weights and optimizer state into `directory` (part of a checkpoint)."""
        ...

    def load(self, directory: Path) -> None: ...


class Evaluator(Protocol):
    every_n_steps: int
    samples_per_prompt: int
    prompts: int | None  # held-out prompts per evaluation; None = the whole split
    sampling: SamplingConfig  # how the eval agent samples

    def metrics(self, batch: list[Sample]) -> dict[str, float]: ...


class Tracker(Protocol):
    run_id: str | None
    tags: dict[str, str]

    def start(self, cfg: DictConfig, extra_params: dict[str, Any] | None = None) -> str: ...

    def resume(self, run_id: str, step: int, tags: dict[str, str]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_samples(self, samples: list[Sample], step: int, decode: Callable[..., Any],
                    name: str = "traces") -> None: ...

    def flush(self) -> None: ...

    def end(self, status: str = "FINISHED", error: str | None = None) -> None: ...
