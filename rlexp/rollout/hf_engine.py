"""transformers `generate` behind the RolloutEngine Protocol, for debugging and platforms
without vLLM. Concurrent requests with equal sampling settings are batched together."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from rlexp.constraints import AtLeast1, AtLeast2, Dtype, Temperature, TopP, UpdateMode
from rlexp.models.local import resolve_dtype
from rlexp.rollout.accounting import BusyMeter, count_generated
from rlexp.rollout.each import generate_each
from rlexp.sample import Generation, SamplingConfig
from rlexp.weights.files import WEIGHTS_FILE, read_shared


class HFEngine:
    takes_images = False
    update_modes: tuple[str, ...] = ("abort", "wait")  # abort waits (see `pause`)
    serves_adapters = False  # LoRA runs reach it merged
    constrains_replies = False  # a `SamplingConfig.constraint` is not applied

    def __init__(
        self,
        model_path: str,
        dtype: Dtype = "float32",
        max_model_len: AtLeast2 = 256,
        max_batch_size: AtLeast1 = 256,
        # sampling defaults (engine.sampling), as for every engine
        seed: int = 0,
        temperature: Temperature = 1.0,
        top_p: TopP = 1.0,
        max_response_tokens: AtLeast1 = 8,
        replicas: AtLeast1 = 1,  # a pool's (cluster=ray); config.py rejects more on one engine
        gpus_per_replica: AtLeast1 = 1,  # one device per replica: no tensor parallelism here
    ):
        self.sampling = SamplingConfig(temperature, top_p, max_response_tokens, seed)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = AutoModelForCausalLM.from_pretrained(model_path,
                                                          dtype=getattr(torch, resolve_dtype(dtype)))
        self.model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' stub for .to
        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.version = 0
        self._pending: list[tuple[list[int], SamplingConfig, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._running = asyncio.Event()  # cleared while paused for a weight update
        self._running.set()
        self.busy = BusyMeter()

    async def generate(self, token_ids: list[int], sampling: SamplingConfig,
                       images: list | None = None) -> Generation:
        return await self.generate_streaming(token_ids, sampling, None, images)

    async def generate_streaming(self, token_ids: list[int], sampling: SamplingConfig,
                                 on_tokens: Callable[[list[int], list[float]], None] | None,
                                 images: list | None = None) -> Generation:
        """`generate`; a batch's replies come whole, so `on_tokens` hears a reply once, when
        it is done."""
        if images:
            raise ValueError("the HF engine takes no images: use rollout=vllm")
        if sampling.requested():
            raise ValueError(f"the HF engine samples with temperature and top_p only, not "
                             f"{', '.join(sampling.requested())}: use rollout=vllm")
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((list(token_ids), sampling, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        gen = await fut
        count_generated(len(gen.token_ids))
        self.busy.tokens += len(gen.token_ids)
        if on_tokens is not None and gen.token_ids:
            on_tokens(gen.token_ids, gen.logprobs)
        return gen

    async def generate_group(self, token_ids: list[int], samplings: list[SamplingConfig]) -> list[Generation]:
        """Each sample's own request: requests of one tick are batched anyway (`_drain`)."""
        return await generate_each(self, token_ids, samplings)

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # let every coroutine of this tick enqueue first
        while self._pending:
            await self._running.wait()
            key = astuple(self._pending[0][1])[:3]
            batch = [p for p in self._pending if astuple(p[1])[:3] == key][: self.max_batch_size]
            taken = {id(b) for b in batch}
            self._pending = [p for p in self._pending if id(p) not in taken]
            async with self._lock:
                self.busy.enter()
                try:
                    gens = await asyncio.to_thread(self._generate_batch, batch)
                except Exception as exc:  # surface to every waiting caller
                    for *_, fut in batch:
                        fut.set_exception(exc)
                    continue
                finally:
                    self.busy.exit()
            for (*_, fut), gen in zip(batch, gens):
                fut.set_result(gen)

    @torch.no_grad()
    def _generate_batch(self, batch) -> list[Generation]:
        sampling: SamplingConfig = batch[0][1]
        width = max(len(ids) for ids, *_ in batch)
        input_ids = torch.tensor([[self.pad_id] * (width - len(i)) + i for i, *_ in batch])
        attention = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i, *_ in batch])
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        greedy = sampling.temperature == 0
        out = self.model.generate(  # type: ignore[misc]  # transformers' stub: self type of generate
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            max_new_tokens=sampling.max_tokens,
            do_sample=not greedy,
            temperature=None if greedy else sampling.temperature,
            top_p=None if greedy else sampling.top_p,
            top_k=None,
            output_scores=True,  # processed scores: the distribution actually sampled from
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
        )
        assert isinstance(out, GenerateDecoderOnlyOutput) and out.scores is not None
        new = out.sequences[:, width:].cpu()
        logprobs = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1).cpu()
        gens = []
        for row, lp in zip(new.tolist(), logprobs):
            ids, finish = [], "length"
            for tid in row:
                ids.append(tid)
                if tid in self.eos_ids:
                    finish = "stop"
                    break
            lps = [lp[i, t].item() for i, t in enumerate(ids)]
            gens.append(Generation(ids, lps, finish, [self.version] * len(ids)))
        return gens

    async def load_weights(self, directory: Path, version: int) -> None:
        async with self._lock:  # not while a batch generates
            self.model.load_state_dict(dict(read_shared(directory / WEIGHTS_FILE)))
            self.version = version

    async def pause(self, mode: UpdateMode) -> None:
        """Waits for the batch being generated: `generate` can neither be cut short nor frozen,
        so "abort" degrades to waiting here (and "keep" is refused by the config check)."""
        self._running.clear()
        await self._lock.acquire()  # held while a batch generates: returns once it is done
        self._lock.release()

    async def resume(self) -> None:
        self._running.set()

    async def sleep(self) -> None:
        """Nothing to release: the model lives in this process (no separate KV cache)."""

    async def wake_up(self) -> None:
        """Nothing to restore (see `sleep`)."""

    def pop_replica_metrics(self) -> dict[str, float]:
        return {}  # one engine: its numbers are the step's (rlexp/step.py rl_step)

    def shutdown(self) -> None:
        """No engine process or temporary files to clean up."""
