"""Runs a verifiers environment (verifiers 0.4, `verifiers.v1`) for rlexp, in verifiers' own
venv: rlexp starts it as `.venv-verifiers/bin/python <this file> --spec JSON`. Run as a file,
it imports nothing of rlexp (stdlib and verifiers only; the protocol's child side,
rlexp/envs/child.py, and rlexp's changes to verifiers, rlexp/envs/verifiers_patches.py, are
loaded by their paths).

The spec (JSON) says what to load:
    env_id      verifiers' own id of the taskset: an importable module (or package) exporting
                its `Taskset` subclass in `__all__` ("vf_arith"; "owner/name@version" as
                verifiers reads hub ids); verifiers' loaders resolve it, its env class and
                its default harness
    env_args    the env's config (`EnvConfig`) over rlexp's defaults, as verifiers' own
                `--env.*` flags would set it: {"taskset": {...}, "agent": {"max_turns": 4}}
    eval_args   taskset config fields for the held-out split (e.g. {"split": "test"}), or
                null: the env has no eval split of its own (rlexp holds tasks out instead)
    paths       directories put first on sys.path and PYTHONPATH (the env's tool servers run
                as `python -m <module>` and must import it too)
    max_concurrent   episodes run at once (each may start its harness program: a process)
    local_scripts    run harness programs (PEP 723 scripts) with this Python when it has
                every package they declare, instead of letting uv resolve them (network)
    sampling    sampling fields sent with every model request (over the request's own)

rlexp's defaults over verifiers': the harness runs in the `subprocess` runtime (verifiers'
default is a hosted sandbox, which needs an account), and a taskset without a harness of its
own gets the `null` harness (verifiers' plain chat loop, tools through MCP; verifiers'
default is `bash`, which runs the model's shell commands on this machine). Refused, with the
reason: an env class other than `SingleAgentEnv` (several agent runs per episode, or judged
against each other: best-of-n, agentic judges), a runtime other than `subprocess`, and a
harness or task that needs a container.

Modes: `--list` prints the tasks (`{"train": [...], "eval": [...] | null, "info": {...}}`) as
one JSON line and exits (rlexp's data source, in preflight); without it the worker serves
requests until its stdin closes (child.py): "episode" runs one episode against rlexp's
server and returns its rewards, "score" re-scores a reply with the task's own rewards."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Run as a file, Python puts this directory first on sys.path, where rlexp/envs/verifiers.py
# would shadow the verifiers package: off it goes.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]


def load_sibling(name: str):
    """rlexp/envs/<name>.py, by its path, under a name no user module has."""
    spec = importlib.util.spec_from_file_location(f"_rlexp_env_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Refused(ValueError):
    """An environment rlexp does not run (the message says why and what to change)."""


class VerifiersEnv:
    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.env_id: str = spec["env_id"]
        for path in reversed(spec.get("paths") or []):
            path = str(Path(path).resolve())
            sys.path.insert(0, path)
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [path] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        import verifiers
        import verifiers.v1 as vf
        from verifiers.v1.utils import loaders

        self.vf, self.version = vf, verifiers.__version__
        args = dict(spec.get("env_args") or {})
        env_cls = loaders.environment_class(self.env_id, str(args.get("id") or ""))
        if env_cls is not vf.SingleAgentEnv:
            raise Refused(f"env class {env_cls.__name__} is not SingleAgentEnv: rlexp runs one agent "
                          f"per episode, scored on its own (several agent runs per episode, or runs "
                          f"judged against each other, as best-of-n and agentic judges do, are not "
                          f"supported)")
        data = merged({"taskset": {"id": self.env_id}, "agent": {"runtime": {"type": "subprocess"}}}, args)
        if not (data["agent"].get("harness") or {}).get("id"):
            bundled = loaders.default_harness_id(self.env_id)
            harness = dict(data["agent"].get("harness") or {})
            harness["id"] = "null" if bundled == "bash" else bundled
            data["agent"]["harness"] = harness
        config = vf.resolve_env_config(data)
        runtime = getattr(config.agent.runtime, "type", "?")
        if runtime != "subprocess":
            raise Refused(f"agent.runtime.type={runtime!r} needs a sandbox (a hosted one needs an account): "
                          f"rlexp runs the harness in the 'subprocess' runtime only")
        self.env = loaders.load_environment(config)
        self.config = config
        harness = self.env._harnesses["agent"]
        if harness.NEEDS_CONTAINER:
            raise Refused(f"harness {harness.config.id!r} needs a container (it drives a third-party "
                          f"program); use the 'null' harness (env_args.agent.harness.id=null)")
        self.harness_id = harness.config.id
        task_cls = type(self.env.taskset).task_type()
        if task_cls.NEEDS_CONTAINER:
            raise Refused(f"task type {task_cls.__name__} needs a container runtime (docker, prime): "
                          f"not supported")
        servers = [*self.env.taskset.toolsets(self.env.taskset.config),
                   *task_cls.toolsets(self.env.taskset.config.task)]
        for server in servers:
            cfg = server.config
            kind = getattr(getattr(cfg, "runtime", None), "type", "subprocess")
            if not getattr(cfg, "url", None) and kind != "subprocess":
                raise Refused(f"tool server {server.server_name!r} runs in a {kind!r} runtime (a sandbox): "
                              f"rlexp runs tool servers in the 'subprocess' runtime only")
        self.tasks: dict[str, list[Any] | None] = {"train": self._tasks(self.env.taskset), "eval": None}
        eval_args = spec.get("eval_args")
        if eval_args:
            taskset_cfg = type(config.taskset).model_validate(merged(config.taskset.model_dump(), eval_args))
            self.tasks["eval"] = self._tasks(loaders.load_taskset(taskset_cfg))
        self.semaphore = asyncio.Semaphore(int(spec.get("max_concurrent") or 16))
        self.sampling = dict(spec.get("sampling") or {})
        self._serving: contextlib.AsyncExitStack | None = None

    def _tasks(self, taskset) -> list[Any]:
        limit = int(self.spec.get("max_tasks") or 100_000)
        if not taskset.bounded:
            taskset = taskset.take(limit)
        tasks: list[Any] = []
        for task in taskset:
            if len(tasks) >= limit:
                raise Refused(f"taskset {self.env_id!r} has more than max_tasks={limit} tasks; "
                              f"raise max_tasks")
            tasks.append(task)
        if not tasks:
            raise Refused(f"taskset {self.env_id!r} has no tasks")
        return tasks

    def info(self) -> dict[str, Any]:
        train, held_out = self.tasks["train"] or [], self.tasks["eval"]
        return {"verifiers": self.version, "env_id": self.config.env_id, "harness": self.harness_id,
                "train_tasks": len(train), "eval_tasks": None if held_out is None else len(held_out)}

    def problem(self, task) -> dict[str, Any]:
        """What rlexp's data source keeps of a task: its prompt as chat messages (as far as
        the task's data says), its reference answer if it has one, its names."""
        data = task.data
        messages: list[dict[str, Any]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        elif data.prompt:
            messages += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt]
        answer = getattr(data, "answer", None)
        if answer is not None and not isinstance(answer, str):
            answer = json.dumps(answer) if not isinstance(answer, (int, float)) else str(answer)
        return {"messages": messages, "answer": answer, "name": data.name, "id": data.id}

    def listing(self) -> dict[str, Any]:
        train, held_out = self.tasks["train"] or [], self.tasks["eval"]
        return {"info": self.info(), "train": [self.problem(t) for t in train],
                "eval": None if held_out is None else [self.problem(t) for t in held_out]}

    async def start(self) -> dict[str, Any]:
        patches = load_sibling("verifiers_patches")
        if self.spec.get("local_scripts", True):
            patches.run_scripts_locally()
        patches.drop_tool_call_indexes()
        self._serving = contextlib.AsyncExitStack()
        await self._serving.enter_async_context(self.env.serving())
        return self.info()

    async def stop(self) -> None:
        if self._serving is not None:
            await self._serving.aclose()

    def task(self, params: dict[str, Any]):
        split, index = params.get("split", "train"), int(params["index"])
        tasks = self.tasks.get(split)
        if tasks is None:
            raise ValueError(f"no {split!r} tasks (the env has no eval split of its own: eval_args is null)")
        if not 0 <= index < len(tasks):
            raise ValueError(f"task index {index} is out of range: the {split} split has {len(tasks)} tasks")
        return tasks[index]

    async def episode(self, params: dict[str, Any]) -> dict[str, Any]:
        """One episode of task `index` of `split` against rlexp's server at `base_url`, every
        model request in rlexp session `session_id` (sent as the body's `session_id`: verifiers
        sends its own trace id as the X-Session-ID header, which rlexp does not know)."""
        vf = self.vf
        task = self.task(params)
        sampling = vf.SamplingConfig.model_validate(
            {**self.sampling, **(params.get("sampling") or {}), "session_id": params["session_id"]})
        client = vf.EvalClientConfig(base_url=params["base_url"], api_key_var="RLEXP_POLICY_API_KEY")
        ctx = vf.ModelContext(model=params.get("model") or "policy", client=client, sampling=sampling)
        async with self.semaphore:
            episode = await self.env.run_episode(task, ctx)
        return summary(episode)

    async def score(self, params: dict[str, Any]) -> dict[str, Any]:
        """The task's own rewards for a reply given as text (`reply`: the last reply, as the
        trace's `last_reply` reads it), offline: rewards that need the runtime are skipped."""
        vf = self.vf
        task = self.task(params)
        trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                           hash=task.hash),
                         agent=vf.AgentInfo(config=self.config.agent), root_reply=str(params["reply"]))
        await task.score(trace)
        return {"reward": trace.reward, "rewards": rewards(trace)}


def rewards(trace) -> dict[str, dict[str, float]]:
    return {name: {"score": r.score, "weight": r.weight}
            for name, r in trace.rewards.items() if r is not None}


def _error(e) -> str:
    return f"{e.type}: {' '.join(str(e.message).split())[:600]}"


def tool_calls(trace) -> int:
    """The tool calls the model made (its replies' `tool_calls`), whether or not a result went
    back: a call in an episode's last turn (max_turns) gets none."""
    return sum(len(m.tool_calls or []) for m in trace.assistant_messages)


def summary(episode) -> dict[str, Any]:
    """What rlexp needs of an episode: its rewards, whether it went wrong and why, its turns."""
    traces = episode.traces
    errors = [_error(e) for e in episode.errors] + [_error(e) for t in traces for e in t.errors]
    out: dict[str, Any] = {"ok": episode.ok, "errors": errors[:5], "traces": len(traces),
                           "is_timeout": episode.is_timeout or any(t.is_timeout for t in traces)}
    if traces:
        trace = traces[-1]
        out |= {"reward": trace.reward, "rewards": rewards(trace),
                "unscored": [name for name, r in trace.rewards.items() if r is None],
                "metrics": {k: v for k, v in trace.metrics.items() if v is not None},
                "num_turns": trace.num_turns, "num_tool_calls": tool_calls(trace),
                "stop_condition": trace.stop_condition, "last_reply": trace.last_reply, "trace_id": trace.id}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="what to load (JSON; see the module docstring)")
    parser.add_argument("--list", action="store_true", help="print the tasks as JSON and exit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    child = load_sibling("child")
    spec = json.loads(args.spec)
    if args.list:
        out = child.take_stdout()
        try:
            listing = VerifiersEnv(spec).listing()
        except Exception as e:  # noqa: BLE001 - one line for rlexp's error message
            logging.getLogger("rlexp.verifiers").debug("load failed", exc_info=True)
            out.write(json.dumps({"error": child.one_line(e)}) + "\n")
            return 1
        out.write(json.dumps(listing) + "\n")
        return 0
    holder: dict[str, VerifiersEnv] = {}

    async def setup() -> dict[str, Any]:
        holder["env"] = VerifiersEnv(spec)
        return await holder["env"].start()

    async def teardown() -> None:
        if "env" in holder:
            await holder["env"].stop()

    async def episode(params):
        return await holder["env"].episode(params)

    async def score(params):
        return await holder["env"].score(params)

    return child.serve(setup, {"episode": episode, "score": score}, teardown)


if __name__ == "__main__":
    sys.exit(main())
