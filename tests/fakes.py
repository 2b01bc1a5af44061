"""A scripted RolloutEngine for unit tests of orchestration logic (never the only test of
a component: the real engines have their own tests)."""

from __future__ import annotations

import asyncio
import os
import random
from functools import partial
from pathlib import Path

from rlexp.protocols import RolloutEngine
from rlexp.rollout.accounting import BusyMeter, count_generated
from rlexp.sample import Generation, SamplingConfig
from rlexp.trainer.sync_check import SyncCheck
from rlexp.weights.files import WEIGHTS_FILE
from rlexp.weights.object_store import ObjectStoreTransport
from rlexp.weights.ram_file import RamFileTransport

# The trainer's sync check measured and logged, never stopping: for hand-made samples, whose
# logprobs are no engine's (trainer.sync_check.bound=off)
UNCHECKED = partial(SyncCheck, bound="off")


class ScriptedEngine(RolloutEngine):
    """Replies with the next scripted text (tokenized), logprob -0.5 per token; records
    every prompt it was given, the sampling asked, and every token list it returned. Streams
    a reply whole (the Protocol's `generate_streaming`)."""

    def __init__(self, tokenizer, replies: list[str], max_model_len: int = 512):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.sampling = SamplingConfig(1.0, 1.0, 200, 0)
        self.max_model_len = max_model_len
        self.version = 0
        self.busy = BusyMeter()
        self.calls: list[tuple[list[int], list[int]]] = []
        self.samplings: list[SamplingConfig] = []  # what each call was asked
        self.images: list[list | None] = []  # each call's images (a vision-language prompt's)

    async def generate(self, token_ids: list[int], sampling: SamplingConfig, images=None) -> Generation:
        self.samplings.append(sampling)
        self.images.append(images)
        text = self.replies.pop(0) if self.replies else "0"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        ids = ids[: sampling.max_tokens]
        finish = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        self.calls.append((list(token_ids), ids))
        return Generation(ids, [-0.5] * len(ids), finish, [self.version] * len(ids))


class TimedEngine(RolloutEngine):
    """A RolloutEngine for scheduler tests: one token every `token_s` seconds, response
    lengths long-tailed (fixed by the request seed), pause/resume like the vLLM engine:
    abort cuts generations short and continues them under the new version, keep freezes them
    until `resume` (their later tokens the new version's, mixed), wait lets them finish."""

    update_modes = ("keep", "abort", "wait")

    def __init__(self, token_s: float = 0.001, max_tokens: int = 64, mean_len: float = 8.0):
        self.token_s = token_s
        self.sampling = SamplingConfig(1.0, 1.0, max_tokens, 0)
        self.max_model_len = 4096
        self.mean_len = mean_len
        self.version = 0
        self.busy = BusyMeter()
        self._running = asyncio.Event()
        self._running.set()
        self._interrupts = 0
        self._thawed = asyncio.Event()  # cleared while a keep pause freezes the generations
        self._thawed.set()
        self.updates_while_generating = 0

    def length(self, seed) -> int:
        rng = random.Random(seed)
        return max(1, min(self.sampling.max_tokens, int(rng.expovariate(1 / self.mean_len)) + 1))

    async def generate(self, token_ids: list[int], sampling: SamplingConfig, images=None) -> Generation:
        n = min(self.length(sampling.seed), sampling.max_tokens)
        ids: list[int] = []
        versions: list[int] = []
        mixed: tuple[int, int] | None = None
        while len(ids) < n:
            await self._running.wait()
            interrupts, sent_at = self._interrupts, self.version
            self.busy.enter()
            try:
                while len(ids) < n and interrupts == self._interrupts:
                    await asyncio.sleep(self.token_s)
                    await self._thawed.wait()
                    if interrupts != self._interrupts:
                        break  # cut short: this token was never produced
                    if mixed is None and self.version != sent_at:
                        mixed = (len(ids), sent_at)
                    ids.append(7)
                    versions.append(self.version)
                    count_generated(1)
                    self.busy.tokens += 1
            finally:
                self.busy.exit()
        finish = "stop" if n < sampling.max_tokens else "length"
        return Generation(ids, [-0.5] * len(ids), finish, versions,
                          mixed_from=mixed and mixed[0], context_version=mixed and mixed[1])

    async def pause(self, mode: str) -> None:
        self._running.clear()
        if mode == "keep":
            self._thawed.clear()
            return
        if mode == "abort":
            self._interrupts += 1
        while self.busy.active:
            await asyncio.sleep(self.token_s / 4)

    async def resume(self) -> None:
        self._thawed.set()
        self._running.set()

    async def load_weights(self, directory, version: int) -> None:
        self.updates_while_generating += self.busy.active > 0
        self.version = version

    async def sleep(self) -> None:
        pass

    async def wake_up(self) -> None:
        pass

    def pop_replica_metrics(self) -> dict[str, float]:
        return {}


class VersionOnlyTransport:
    """A WeightTransport for fake engines and trainers, which have no weights: it consumes
    the trainer's (empty) weights and tells the engine the new version."""

    engine_backend = None

    async def transfer(self, weights, engine, version: int) -> None:
        assert not list(weights)
        await engine.load_weights(None, version)

    def close(self) -> None:
        pass


class ScoreOnlyJudge:
    """A judge written without the Protocol's optional `bind` (and not subclassing Judge)."""

    def __init__(self, correct_reward: float = 1.0, format_reward: float = 0.0):
        self.correct_reward = correct_reward

    async def score(self, sample):
        sample.reward = self.correct_reward
        return sample


class StopsSending(RamFileTransport):
    """ram_file that writes the weights only for the first `sends` syncs; after that it still
    has the engine reload (the file it holds, stale) and announce the new version: a transport
    that returns without sending."""

    def __init__(self, directory: str | None = None, cluster=None, sends: int = 1):
        super().__init__(directory, cluster)
        self.sends = sends

    async def transfer(self, weights, engine, version: int) -> None:
        if self.sends > 0:
            self.sends -= 1
            self.file.write((name, t.to("cpu", copy=False)) for name, t in weights)
        await engine.load_weights(self.directory, version)


class NeverReaches(RamFileTransport):
    """ram_file whose transfer creates the engine's reload and drops it unawaited (Python's
    "coroutine was never awaited" warning is all that shows): it returns at once, the engine
    keeps its weights and its version."""

    async def transfer(self, weights, engine, version: int) -> None:
        self.file.write((name, t.to("cpu", copy=False)) for name, t in weights)
        engine.load_weights(self.directory, version)  # the planted fault: never awaited


class HangsInReload(RamFileTransport):
    """ram_file whose engine reload never finishes: the engine's workers open a FIFO as the
    weights file and wait for a writer that never comes (a hung transfer, inside the engine)."""

    async def transfer(self, weights, engine, version: int) -> None:
        fifo_dir = self.directory / "hang"  # removed with the transport's directory
        fifo_dir.mkdir(exist_ok=True)
        os.mkfifo(fifo_dir / WEIGHTS_FILE)
        await engine.load_weights(fifo_dir, version)


class MarksPush(ObjectStoreTransport):
    """object_store that, before each push, writes `<marks>/push_<version>` and waits
    `pause_s`: a test can take a node down while a weight push is under way."""

    def __init__(self, marks: str, pause_s: float = 2.0, cluster=None):
        super().__init__(cluster)
        self.marks, self.pause_s = Path(marks), pause_s

    async def transfer(self, weights, engine, version: int) -> None:
        self.marks.mkdir(parents=True, exist_ok=True)
        (self.marks / f"push_{version}").touch()
        await asyncio.sleep(self.pause_s)
        await super().transfer(weights, engine, version)
