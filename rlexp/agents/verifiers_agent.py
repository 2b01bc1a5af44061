"""VerifiersAgent (`agent=verifiers data=verifiers`): a verifiers environment (verifiers 0.4,
`verifiers.v1`) runs unchanged, in its own venv, against the policy.

verifiers lives in `.venv-verifiers` (`make envs`), never in rlexp's: its worker
(rlexp/envs/verifiers_worker.py) runs there as a child process (rlexp/envs/process.py). Per
rollout the agent opens a recording session on rlexp's OpenAI-compatible server, asks the
worker to run the episode of the sample's task (`metadata["task_index"]`, from
data=verifiers) with every model request in that session, and turns the session into the
training samples: the tokens are rlexp's own (policy versions, prefix breaks, traces); the
env's rewards become the samples' reward.

- reward: the env's total (each named `@vf.reward`'s score times its weight, summed);
- reward_components: each named reward's score, and `correct`: 1.0 when the reward named
  `correct_reward` (default `correct`; the total if the env has none of that name) is at
  least `correct_threshold`, else 0.0 (rollout/accuracy, eval/accuracy);
- per-sample metrics `verifiers/reward/<name>_mean`, `verifiers/metric/<name>_mean` (the
  env's `@vf.metric`s), `verifiers/turns_mean`, `verifiers/tool_calls_mean`, logged per step;
- an episode that went wrong (the harness or a tool server failed, a reward raised, the env
  timed out, the worker died) fails its sample with the env's reason (a counted failure;
  rlexp/guards.py); the run goes on.

The env's harness program and tool servers run as the env says, in verifiers' `subprocess`
runtime on this machine; envs that need a sandbox or a container, and envs that run several
agents per episode or judge runs against each other, are refused when the worker loads them
(rlexp/envs/verifiers_worker.py says why)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

from rlexp.agents.single_turn import request_seed
from rlexp.chat.client import SessionStore
from rlexp.chat.server import ChatServer
from rlexp.chat.session import PrefixBreak
from rlexp.chat.tool_prompt import ToolPrompt
from rlexp.envs.process import ChildProcess
from rlexp.envs.verifiers import DEFAULT_PYTHON, check_python, spec, worker
from rlexp.protocols import Agent, Judge, RolloutEngine
from rlexp.sample import Sample, SamplingConfig


class VerifiersEpisodeError(RuntimeError):
    """The env's episode went wrong (its reason is the env's own)."""


# Workers by what they run (python, spec, api key) and their event loop, shared by the agents
# of one process (the training agent and the eval agent run the same env: one worker, started
# once), with a count of their users; the last user's aclose closes it.
_WORKERS: dict[str, tuple[ChildProcess, int]] = {}


class VerifiersAgent(Agent):
    sends_images = False

    def __init__(self, engine: RolloutEngine, tokenizer, judge: Judge, env_id: str | None = None,
                 env_args: dict[str, Any] | None = None, eval_args: dict[str, Any] | None = None,
                 paths: list[str] | None = None, python: str = DEFAULT_PYTHON,
                 sampling: SamplingConfig | None = None, request_sampling: dict[str, Any] | None = None,
                 max_concurrent: int = 16, local_scripts: bool = True,
                 correct_reward: str | None = "correct", correct_threshold: float = 1.0,
                 startup_timeout_s: float = 300.0, max_restarts: int = 3,
                 host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 on_prefix_break: PrefixBreak = "split", tool_prompt: ToolPrompt = "auto"):
        check_python(python, "agent.python")
        self.spec = spec(env_id, env_args, eval_args, paths, max_concurrent=max_concurrent,
                         local_scripts=local_scripts, sampling=request_sampling or {})
        self.python, self.api_key = python, api_key
        self.startup_timeout_s, self.max_restarts = startup_timeout_s, max_restarts
        self.correct_reward, self.correct_threshold = correct_reward, correct_threshold
        self.sampling = sampling or engine.sampling
        self.host, self.port = host, port
        self.store = SessionStore(engine, tokenizer, engine.max_model_len, on_prefix_break,
                                  tool_prompt=tool_prompt)
        self.server: ChatServer | None = None
        self.worker: ChildProcess | None = None
        self._key = json.dumps([self.python, self.spec, api_key], sort_keys=True)
        self._start_lock = asyncio.Lock()

    async def _started(self) -> tuple[ChatServer, ChildProcess]:
        async with self._start_lock:
            if self.server is None:
                server = ChatServer(self.store, self.host, self.port, self.api_key)
                await server.start()
                self.server = server
            if self.worker is None:  # a worker belongs to the event loop it was started on
                self._key += f" loop {id(asyncio.get_running_loop())}"
                shared, users = _WORKERS.get(self._key) or (None, 0)
                if shared is None:
                    shared = worker(self.python, self.spec, self.api_key, self.startup_timeout_s,
                                    self.max_restarts)
                _WORKERS[self._key] = (shared, users + 1)
                self.worker = shared
        await self.worker.start()  # its own lock; restarts a worker that died
        return self.server, self.worker

    async def rollout(self, sample: Sample) -> list[Sample]:
        index = sample.metadata.get("task_index")
        if index is None:
            raise VerifiersEpisodeError(f"sample {sample.uid} names no verifiers task (metadata task_index): "
                                        f"agent=verifiers runs the tasks of data=verifiers")
        server, child = await self._started()
        request = {"index": index, "split": sample.metadata.get("task_split", "train"),
                   "base_url": server.base_url, "model": self.store.model_name}
        # the session's sampling: requests leave it to the session (the harness sets none of it)
        sampling = replace(self.sampling, seed=request_seed(self.sampling.seed, sample))
        async with self.store.record(sampling) as rec:
            result = await child.request("episode", request | {"session_id": rec.session_id})
        samples = rec.samples(sample)
        name = f"verifiers env {self.spec['env_id']!r}"
        errors = "; ".join(result.get("errors") or [])
        if not result.get("ok") or result.get("reward") is None:
            timeout = " (timed out)" if result.get("is_timeout") else ""
            raise VerifiersEpisodeError(f"{name}: episode of task {index} failed{timeout}: "
                                        f"{errors or 'no reward'}")
        if not samples:
            raise VerifiersEpisodeError(f"{name}: episode of task {index} made no policy calls")
        self._score(samples, result)
        return samples

    def _score(self, samples: list[Sample], result: dict[str, Any]) -> None:
        scores = {name: float(r["score"]) for name, r in (result.get("rewards") or {}).items()}
        total = float(result["reward"])
        decisive = scores.get(self.correct_reward, total) if self.correct_reward else total
        metrics = {f"verifiers/reward/{k}_mean": v for k, v in scores.items()}
        metrics |= {f"verifiers/metric/{k}_mean": float(v) for k, v in (result.get("metrics") or {}).items()}
        metrics |= {"verifiers/turns_mean": float(result.get("num_turns") or 0),
                    "verifiers/tool_calls_mean": float(result.get("num_tool_calls") or 0)}
        info = {k: result.get(k) for k in ("trace_id", "num_turns", "num_tool_calls", "stop_condition",
                                           "metrics", "unscored")}
        for s in samples:
            s.reward = total
            s.reward_components = scores | {"correct": float(decisive >= self.correct_threshold)}
            s.metadata["metrics"] = dict(metrics)
            s.metadata["verifiers"] = info

    async def aclose(self) -> None:
        if self.worker is not None:
            shared, users = _WORKERS.pop(self._key, (self.worker, 1))
            if users > 1:
                _WORKERS[self._key] = (shared, users - 1)
            else:
                await self.worker.aclose()
            self.worker = None
        if self.server is not None:
            await self.server.stop()
            self.server = None
