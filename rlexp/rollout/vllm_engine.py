"""vLLM behind the RolloutEngine Protocol: token ids in; token ids, sampling logprobs out."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import torch

from rlexp import orphans
from rlexp.constraints import AtLeast0, AtLeast1, AtLeast2, Dtype, Temperature, TopP
from rlexp.models.vlm import placeholder_ids
from rlexp.rollout import reaper, vllm_args, vllm_routing
from rlexp.rollout.accounting import BusyMeter, count_generated
from rlexp.rollout.each import generate_each
from rlexp.rollout.vllm_adapters import Adapters, adapts_unembedding, lora_args
from rlexp.rollout.vllm_groups import Reply, RequestGroups
from rlexp.rollout.vllm_images import ImagePlaceholders
from rlexp.rollout.vllm_liveness import engine_alive, watched
from rlexp.rollout.vllm_outputs import Segments, prompt_scores, reply, report_new
from rlexp.rollout.vllm_sampling import groupable, one_request, sampling_params
from rlexp.rollout.vllm_transfer import NativeTransfer
from rlexp.rollout.vllm_updates import WeightUpdates
from rlexp.sample import Generation, PromptLogprobs, SamplingConfig

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 20.0  # for the engine process to exit by itself before vLLM kills it


def cache_salt(version: int) -> str:
    """A request's prefix-cache salt: the policy version it was sent at. A request never reuses
    KV blocks that requests sent at another version wrote."""
    return f"v{version}"


class VLLMEngine(NativeTransfer, WeightUpdates):
    """An in-process `AsyncLLM` (its engine core runs in a child process).

    Weights: `load_weights` reloads a safetensors file in place in the engine's workers,
    from a shared mapping of it (rlexp/weights/vllm_worker.py, rlexp/weights/files.py)."""

    takes_images = True  # a vision-language model's images (`generate(images=...)`)
    update_modes: tuple[str, ...] = ("keep", "abort", "wait")
    serves_adapters = True  # LoRA adapters by name (rollout.max_lora_rank > 0; rlexp/rollout/vllm_updates.py)
    constrains_replies = True  # `SamplingConfig.constraint`: regex / JSON-schema structured outputs

    def __init__(
        self,
        model_path: str,
        seed: int,
        temperature: Temperature = 1.0,
        top_p: TopP = 1.0,
        max_response_tokens: AtLeast1 = 8,
        dtype: Dtype = "float32",
        max_model_len: AtLeast2 = 256,
        max_num_seqs: AtLeast1 = 256,
        kv_cache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = False,
        enforce_eager: bool = True,
        max_num_batched_tokens: int = 8192,
        weight_transfer_backend: str | None = None,
        idle_spin_s: float | None = 0.05,
        replicas: AtLeast1 = 1,  # a pool's (cluster=ray); config.py rejects more on one engine
        gpus_per_replica: AtLeast1 = 1,
        routing_capture: bool = False,
        group_requests: bool = True,
        max_lora_rank: AtLeast0 = 0,
        max_loras: AtLeast1 = 1,
        max_cpu_loras: AtLeast1 = 4,
    ):
        """routing_capture: each Generation carries the experts every MoE layer chose per computed
        token (`routed_experts`): vLLM's on a GPU, rlexp's worker hook on the CPU (vllm_routing.py).
        group_requests: a prompt group's requests go out as one request with n (the same tokens;
        rlexp/rollout/vllm_groups.py); false sends each sample as its own request.
        max_lora_rank: serve LoRA adapters of up to this rank (0: none; rlexp/rollout/vllm_adapters.py),
        `max_loras` of them in one engine step, `max_cpu_loras` kept loaded."""
        on_gpu = torch.cuda.is_available()
        kwargs = vllm_args.engine_args(model_path, seed, dtype, max_model_len, max_num_seqs, enforce_eager,
                                       max_num_batched_tokens, enable_sleep_mode, on_gpu)
        kwargs |= vllm_args.device_args(on_gpu, kv_cache_gb, gpu_memory_utilization, gpus_per_replica,
                                        weight_transfer_backend, routing_capture)
        kwargs |= lora_args(max_lora_rank, max_loras, max_cpu_loras)
        self.adapters = Adapters(max_lora_rank)
        self.policy_adapter: str | None = None  # the adapter every request uses (a LoRA run's policy)
        self._start(kwargs, on_gpu)
        self.adapts_unembedding = max_lora_rank > 0 and adapts_unembedding(self.llm.model_config)
        self.sampling = SamplingConfig(temperature, top_p, max_response_tokens, seed)
        self.max_model_len = max_model_len
        self.sleeps = enable_sleep_mode and on_gpu
        self.version = 0  # the weights at model_path; the loop names each later version
        self._ids, self.busy = itertools.count(), BusyMeter()
        self._running = asyncio.Event()  # cleared while paused for a weight update
        self._running.set()
        self._interrupts = 0  # pauses that cut requests short so far
        self._keeping = False  # paused in keep mode: requests hold their KV through the update
        self._labelled = False  # vLLM told the version of its weights (before the first request)
        self._idle_spin_s = idle_spin_s  # applied to the workers before the first request
        self.routing_capture = routing_capture
        self._routing_fetcher = vllm_routing.RoutingFetcher(
            lambda ids: self._call(self.llm.collective_rpc("take_routing", args=(ids,))))
        self._install_capture = routing_capture and not on_gpu  # in the workers, before the first request
        self._groups = RequestGroups(self._request_n) if group_requests else None
        self.model_path = model_path
        self._placeholders: ImagePlaceholders | None = None  # made at the first image prompt
        self.unsampled = placeholder_ids(self.llm.model_config.hf_config)  # a VLM's image placeholders

    def _start(self, kwargs: dict[str, Any], on_gpu: bool) -> None:
        """vLLM's IPC sockets go into a directory of this engine's, so that a later run can
        remove them (and the /dev/shm segments listed there) if this process is killed."""
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.time()
        orphans.reap(reaper.TEMP_PREFIX)
        self._temp, self._temp_lock = orphans.owned_tempdir(reaper.TEMP_PREFIX)
        self._reaper = reaper.start()
        before, names_before = reaper.snapshot(), reaper.temp_names()
        env = {"VLLM_RPC_BASE_PATH": str(self._temp), **({} if on_gpu else vllm_args.CPU_ENV)}
        try:
            with vllm_args.environment(**env), reaper.watching(self._reaper):
                self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        except BaseException:
            reaper.stop(self._reaper)  # whatever the failed start left running
            raise
        orphans.own(self._temp, reaper.new_temp_files(before, names_before))
        log.info("vLLM engine up in %.1fs (%s)", time.time() - t0, "gpu" if on_gpu else "cpu")

    async def generate(self, token_ids: list[int], sampling: SamplingConfig,
                       images: list[Any] | None = None) -> Generation:
        """One completion. If `pause("abort")` cuts it short, it waits for `resume` and
        continues from the tokens it has under the new weights (partial rollout); a completion
        whose distribution depends on the reply so far (a grammar, penalties) restarts instead.
        `images` (a vision-language model's; PIL images): one per image in `token_ids`, in
        order, whose placeholder tokens the processor has already expanded."""
        return await self.generate_streaming(token_ids, sampling, None, images)

    async def generate_streaming(self, token_ids: list[int], sampling: SamplingConfig,
                                 on_tokens: Callable[[list[int], list[float]], None] | None,
                                 images: list[Any] | None = None) -> Generation:
        """`generate`, calling `on_tokens(ids, logprobs)` with each engine step's new tokens as
        they come (a restarted completion's tokens are reported again from its start)."""
        return await self._complete(token_ids, sampling, Segments(), on_tokens, images)

    async def _complete(self, token_ids: list[int], sampling: SamplingConfig, done: Segments,
                        on_tokens: Callable[[list[int], list[float]], None] | None = None,
                        images: list[Any] | None = None) -> Generation:
        """The completion from its pieces so far (`done`) to its end."""
        while True:
            await self._running.wait()
            interrupts = self._interrupts
            if done.pieces:  # the prompt and the tokens so far, prefilled again
                self.busy.prefilled_again += len(token_ids) + len(done.ids)
            piece = await self._segment(list(token_ids) + done.ids, done.rest(sampling), on_tokens, images)
            gen = self._take(done, piece, sampling, self._interrupts != interrupts)
            if gen is not None:
                return gen

    @staticmethod
    def _take(done: Segments, piece: tuple, sampling: SamplingConfig, paused: bool) -> Generation | None:
        """Add a request's reply to `done`: the whole completion, or None where a pause that
        aborted requests cut it short and tokens are left to generate."""
        ids, logprobs, top, finish, versions, sent_at, routing = piece
        interrupted = finish == "abort" and paused
        if interrupted and sampling.depends_on_the_reply:
            done.restart(routing)  # again from its start
        else:
            done.add(ids, logprobs, top, versions, sent_at, routing)
        if not interrupted or len(done.ids) >= sampling.max_tokens:
            return done.generation("length" if interrupted else finish, sampling.top_logprobs)
        return None

    async def generate_group(self, token_ids: list[int], samplings: list[SamplingConfig]) -> list[Generation]:
        """`generate` for each sampling, as one request with n where they can go together (the
        same settings, seeds that follow each other: rlexp/rollout/vllm_groups.py), awaited in
        this one coroutine; a completion an abort cut short continues on its own."""
        if self._groups is None or not one_request(samplings, self.unsampled, self.routing_capture):
            return await generate_each(self, token_ids, samplings)
        await self._running.wait()
        interrupts = self._interrupts
        replies = await self._request_n(token_ids, samplings[0], len(samplings))
        pieces = [Segments() for _ in samplings]
        gens = [self._take(done, (*r, None), s, self._interrupts != interrupts)
                for done, r, s in zip(pieces, replies, samplings)]
        cut = [i for i, gen in enumerate(gens) if gen is None]  # by an abort: each goes on alone
        rests = await asyncio.gather(*(self._complete(token_ids, samplings[i], pieces[i]) for i in cut))
        for i, gen in zip(cut, rests):
            gens[i] = gen
        return gens  # type: ignore[return-value]  # None no more

    async def _segment(self, token_ids: list[int], sampling: SamplingConfig,
                       on_tokens: Callable[[list[int], list[float]], None] | None,
                       images: list[Any] | None):
        """One request for (what is left of) a completion: with the other samples of its
        group where it can be."""
        if (self._groups is not None and on_tokens is None and not images
                and groupable(sampling, self.unsampled, self.routing_capture)):
            return *await self._groups.request(token_ids, sampling), None
        return await self._request(token_ids, sampling, on_tokens, images)

    async def _request(self, token_ids: list[int], sampling: SamplingConfig,
                       on_tokens: Callable[[list[int], list[float]], None] | None = None,
                       images: list[Any] | None = None):
        from vllm.inputs import TokensPrompt

        params = sampling_params(sampling, self.unsampled)
        sent_at = self.version
        prompt: TokensPrompt = {"prompt_token_ids": token_ids, "cache_salt": cache_salt(sent_at)}
        if images:
            if self._placeholders is None:
                self._placeholders = ImagePlaceholders(self.model_path)
            prompt = {"prompt_token_ids": self._placeholders.collapse(token_ids, len(images)),
                      "multi_modal_data": {"image": list(images)}, "cache_salt": cache_salt(sent_at)}
        await self._before_first_request()
        final, counted, version, reported = None, 0, self.version, 0
        request_id = f"r{next(self._ids)}"
        self.busy.enter()
        try:
            with engine_alive():
                async for out in self.llm.generate(prompt, params, request_id=request_id,
                                                   lora_request=self._adapter(sampling.adapter)):
                    if final is None:
                        # Read at the first output, not at submission: a request that reached the
                        # engine while it was paused runs after the update, on the new weights.
                        version = self.version
                    if on_tokens is not None:  # outputs are cumulative (one object, updated)
                        reported = report_new(out.outputs[0], reported, on_tokens)
                    final = out
        finally:  # also on cancellation: the tokens were generated all the same
            self.busy.exit()
            if final is not None:
                counted = len(final.outputs[0].token_ids)
            count_generated(counted)
            self.busy.tokens += counted
        assert final is not None
        if images and list(final.prompt_token_ids or []) != list(token_ids):
            raise ValueError("image prompt: vLLM expanded the images into other tokens than the prompt's "
                             f"({len(final.prompt_token_ids or [])} tokens, not {len(token_ids)})")
        completion = final.outputs[0]
        routing = await self._routing(request_id, completion) if self.routing_capture else None
        return *reply(completion, sampling.top_logprobs, version, sent_at), routing

    async def _before_first_request(self) -> None:
        if not self._labelled:  # each token's version comes back in vLLM's weight-version spans
            self._labelled = True
            await self._call(self.llm.update_weight_version(str(self.version)))
        if self._idle_spin_s is not None:
            spin, self._idle_spin_s = self._idle_spin_s, None
            await self._call(self.llm.collective_rpc("set_idle_spin", args=(spin,)))
        if self._install_capture:
            self._install_capture = False
            if not all(await self._call(self.llm.collective_rpc("enable_routing_capture"))):
                raise ValueError("rollout.routing_capture: the model has no MoE layer to capture")

    async def _request_n(self, token_ids: list[int], sampling: SamplingConfig, n: int) -> list[Reply]:
        """One request for the seeds `sampling.seed`, ..., `sampling.seed + n - 1` (vLLM's `n`);
        the replies in seed order, each with the version at its own first output."""
        from vllm.inputs import TokensPrompt

        await self._before_first_request()
        last: dict[int, Any] = {}  # each child's completion (cumulative), by its index
        versions: dict[int, int] = {}
        sent_at = self.version
        self.busy.enter()
        try:
            with engine_alive():
                params = sampling_params(sampling, self.unsampled, n)
                prompt: TokensPrompt = {"prompt_token_ids": token_ids, "cache_salt": cache_salt(sent_at)}
                async for out in self.llm.generate(prompt, params, request_id=f"r{next(self._ids)}",
                                                   lora_request=self._adapter(sampling.adapter)):
                    for completion in out.outputs:
                        versions.setdefault(completion.index, self.version)
                        last[completion.index] = completion
        finally:  # also on cancellation: the tokens were generated all the same
            self.busy.exit()
            counted = sum(len(c.token_ids) for c in last.values())
            count_generated(counted)
            self.busy.tokens += counted
        never_started: Reply = ([], [], [], "abort", [], sent_at)  # aborted before its first token
        return [reply(last[i], sampling.top_logprobs, versions[i], sent_at) if i in last else never_started
                for i in range(n)]

    async def score(self, token_ids: list[int], top_k: int = 0, adapter: str | None = None) -> PromptLogprobs:
        """The model's logprob of each token given the ones before (vLLM's prompt logprobs, of
        the raw distribution: temperature 1), with its `top_k` likeliest ids per position;
        `adapter`: by that LoRA adapter's weights (as `SamplingConfig.adapter`)."""
        from vllm import SamplingParams

        params, final = SamplingParams(max_tokens=1, prompt_logprobs=top_k, detokenize=False), None
        with engine_alive():
            request_id = f"s{next(self._ids)}"
            async for out in self.llm.generate({"prompt_token_ids": token_ids}, params, request_id=request_id,
                                               lora_request=self._adapter(adapter)):
                final = out
        return prompt_scores(final, token_ids, top_k)

    def _adapter(self, name: str | None) -> Any:
        """The `LoRARequest` of adapter `name`, else of the policy's adapter; None for neither."""
        return self.adapters.request(name or self.policy_adapter)

    async def _routing(self, request_id: str, completion: Any) -> np.ndarray:
        """[prompt + generated - 1, layers, k] expert ids: vLLM's on a GPU, the workers' on the CPU."""
        if completion.routed_experts is not None:
            return np.asarray(completion.routed_experts)
        return await self._routing_fetcher.get(request_id)

    async def _call(self, call: Awaitable[Any]) -> Any:
        """Await a call into the engine process, EngineDead if the process dies meanwhile
        (rlexp/rollout/vllm_liveness.py)."""
        return await watched(self.llm, call)

    async def sleep(self) -> None:
        if self.sleeps:
            await self._call(self.llm.sleep(level=1))

    async def wake_up(self) -> None:
        if self.sleeps:
            await self._call(self.llm.wake_up())

    def pop_replica_metrics(self) -> dict[str, float]:
        return {}  # one engine: its numbers are the step's (rlexp/step.py rl_step)

    def shutdown(self) -> None:
        # Drop the engine now: its destructor calls shutdown again, which fails noisily
        # (TypeError) when it only runs during interpreter exit.
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        try:
            # vLLM's default 5 s is less than its engine process may need to tear down
            # (4-6 s on 2 cores): it then SIGKILLs the engine mid-teardown and warns. A
            # dead engine process is not waited for.
            llm.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        finally:
            reaper.stop(self._reaper)
            orphans.remove(self._temp, self._temp_lock)
        del llm
        gc.collect()
