"""Real verifiers environments (verifiers 0.4 in .venv-verifiers, `make envs`), each in its own
Python (the child-process protocol: test_env_process.py), against one real vLLM engine: a
single-turn env and a multi-turn env with a tool, a worker killed mid-run; then bad input,
a broken env stopped in preflight, and one whole run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlexp.envs.process import EnvProcessError

ROOT = Path(__file__).resolve().parents[1]


# --- real verifiers environments (verifiers 0.4 in .venv-verifiers) ---------------------------

VENV_PYTHON = ROOT / ".venv-verifiers" / "bin" / "python"
ENVS = ROOT / "examples" / "environments"
CONF = ROOT / "conf"
HANG_FAILSAFE_S = 600
SMALL = "{taskset: {max_operand: 29, eval_size: 10}}"


def require_venv() -> None:
    """Not a skip: the verifiers venv is part of the test setup (`make test` makes it)."""
    if not os.access(VENV_PYTHON, os.X_OK):
        pytest.fail(f"{VENV_PYTHON} is missing: verifiers environments run in their own venv; "
                    f"run `make envs` to create .venv-verifiers")


def _cfg(*overrides: str, defaults: bool = False):
    """The config of agent=verifiers data=verifiers; `defaults`: its own env paths and Python,
    else this checkout's, given."""
    from hydra import compose, initialize_config_dir

    import rlexp.config  # noqa: F401 - registers the resolvers the configs use

    base = ["agent=verifiers", "data=verifiers"]
    if not defaults:
        base += [f"data.source.paths=[{ENVS}]", f"data.source.python={VENV_PYTHON}"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=[*base, *overrides])


@pytest.fixture(scope="module")
def vllm(tiny_model_path, tokenizer):
    """One real vLLM engine for the module, on an event loop in a background thread."""
    require_venv()
    from tests.conftest import vllm_on_thread

    with vllm_on_thread(tiny_model_path, HANG_FAILSAFE_S, seed=0, max_model_len=384, kv_cache_gb=0.25,
                        max_num_seqs=32, max_response_tokens=16) as (engine, run):
        yield SimpleNamespace(engine=engine, run=run, tokenizer=tokenizer)


def _setup(vllm, *overrides: str, **runtime):
    """The data source and the guarded agent of `overrides`, built as a run builds them
    (`runtime`: more keyword arguments for the agent, such as `sampling`)."""
    from hydra.utils import instantiate

    from rlexp.guards import AgentGuard
    from rlexp.loop import build_guarded

    cfg = _cfg(*overrides)
    source = instantiate(cfg.data.source)

    async def build():
        return build_guarded(cfg, "agent", AgentGuard, engine=vllm.engine, tokenizer=vllm.tokenizer,
                             judge=None, **runtime, _convert_="object")  # as rlexp.loop builds it

    return source, vllm.run(build())


def _samples(source, split: str, prompts: int, per_prompt: int = 2):
    from rlexp.data.manager import DataManager

    data = DataManager(source, prompts_per_step=prompts, samples_per_prompt=per_prompt, seed=0, split=split)
    return [s for group in data.sample_groups(prompts) for s in group]


async def _gather(coros):
    return await asyncio.gather(*coros)


def _check_traces(samples, tokenizer) -> None:
    """Every trace turn's text is exactly the decode of its token span; the turns tile the tokens."""
    for s in samples:
        spans = [t["span"] for t in s.turns]
        assert spans[0][0] == 0 and spans[-1][1] == len(s.tokens)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for turn in s.turns:
            start, end = turn["span"]
            assert turn["text"] == tokenizer.decode(s.tokens[start:end]), turn
        assert len(s.tokens) == len(s.loss_mask) == len(s.logprobs) == len(s.versions)


def _rescored(vllm, agent, s) -> dict:
    """The env's own score of the completion rlexp trains on (its last policy turn, as the
    server answered it), from the worker's `score`, read off the sample's trace line alone
    (what the trace artifact holds): the task by its index and split, the reply by its tokens."""
    line = json.loads(json.dumps(s.to_trace(vllm.tokenizer.decode)))
    assert line["metadata"]["verifiers"] == s.metadata["verifiers"]
    last = [t for t in line["turns"] if t["mask"]][-1]
    reply = vllm.tokenizer.decode(line["token_ids"][slice(*last["span"])], skip_special_tokens=True)
    task = line["metadata"]
    request = {"index": task["task_index"], "split": task["task_split"], "reply": reply}
    return vllm.run(agent.agent.worker.request("score", request))


def test_single_turn_env(vllm):
    source, agent = _setup(vllm, "data.source.env_id=vf_arith", f"data.source.env_args={SMALL}",
                           "data.source.eval_args={split: eval}")
    try:
        assert source.info["env_id"] == "vf_arith" and source.info["harness"] == "null"
        assert len(source.problems("train")) == 890
        assert len(source.problems("eval")) == 10  # the env's own eval split
        p = source.problems("eval")[0]
        assert p.messages[0]["role"] == "user" and p.messages[0]["content"].endswith("=")
        assert p.metadata["task_split"] == "eval" and p.answer == str(eval(p.messages[0]["content"][:-1]))
        samples = _samples(source, "train", 3) + _samples(source, "eval", 1)
        results = vllm.run(_gather(agent.rollout(s) for s in samples))
        out = [s for r in results for s in r]
        assert len(out) == len(samples)
        _check_traces(out, vllm.tokenizer)
        for s in out:
            assert [t["role"] for t in s.turns] == ["prompt", "assistant"]
            env = _rescored(vllm, agent, s)
            assert s.reward == env["reward"] and s.reward_components == {
                "correct": env["rewards"]["correct"]["score"]}
            assert s.metadata["metrics"]["verifiers/turns_mean"] == 1.0
            assert s.metadata["verifiers"]["stop_condition"] == "agent_completed"
        # the env scores a right answer 1 (so the rewards above were no accident of zeros)
        right = {"index": 0, "split": "eval", "reply": source.problems("eval")[0].answer}
        assert vllm.run(agent.agent.worker.request("score", right))["reward"] == 1.0
    finally:
        vllm.run(agent.aclose())


def test_multi_turn_env_with_a_tool(vllm):
    """The model must call the calculator (tool_choice=required: rlexp's structured outputs
    make the tiny model's reply a valid call): the question, the call, the tool server's
    result, a second call; max_turns=2 ends the episode."""
    from dataclasses import replace

    source, agent = _setup(vllm, "data.source.env_id=vf_arith_tool",
                           "data.source.env_args={taskset: {max_operand: 29, eval_size: 10}, "
                           "agent: {max_turns: 2}}",
                           "agent.request_sampling={tool_choice: required}",
                           sampling=replace(vllm.engine.sampling, max_tokens=100))  # room for a call
    try:
        samples = _samples(source, "train", 2)
        results = vllm.run(_gather(agent.rollout(s) for s in samples))
        out = [s for r in results for s in r]
        _check_traces(out, vllm.tokenizer)
        for s in out:
            roles = [t["role"] for t in s.turns]
            assert roles[:4] == ["prompt", "assistant", "tool", "assistant"], roles
            assert "<tool_call>" in s.turns[1]["text"]
            call = json.loads(s.turns[1]["text"].split("<tool_call>")[1].split("</tool_call>")[0])
            assert call["name"] == "calculator"
            info = s.metadata["verifiers"]
            # the calls the model made: the last turn's call too, whose result never went back
            calls = sum(t["text"].count("<tool_call>") for t in s.turns if t["role"] == "assistant")
            assert info["num_turns"] == 2 and info["num_tool_calls"] == calls >= 1
            assert s.metadata["metrics"]["verifiers/tool_calls_mean"] == calls
            assert info["stop_condition"] == "max_turns"
            assert s.metadata["metrics"]["verifiers/metric/tool_calls_mean"] == info["num_tool_calls"]
            env = _rescored(vllm, agent, s)
            assert s.reward == env["reward"]
    finally:
        vllm.run(agent.aclose())


def test_worker_killed_mid_run_is_a_counted_failure(vllm):
    from rlexp.guards import PROGRAMMING_ERRORS
    from rlexp.sample import Status
    from rlexp.schedulers.sync import collect

    source, agent = _setup(vllm, "data.source.env_id=vf_arith", f"data.source.env_args={SMALL}")
    try:
        # no eval_args: data.source.eval_size (200) train tasks held out by seed
        held_out = {p.metadata["task_index"] for p in source.problems("eval")}
        assert len(held_out) == 200
        assert {p.metadata["task_split"] for p in source.problems("eval")} == {"train"}
        assert not held_out & {p.metadata["task_index"] for p in source.problems("train")}
        samples = _samples(source, "train", 3)

        async def kill_mid_run():
            tasks = [asyncio.ensure_future(agent.rollout(s)) for s in samples]
            await asyncio.sleep(0)
            worker = agent.agent.worker
            while worker is None or worker.pid is None or not worker._pending:
                await asyncio.sleep(0.05)
                worker = agent.agent.worker
            os.kill(worker.pid, signal.SIGKILL)
            # a failsafe, not a threshold: the requests in flight end with the death (a hang raises)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 600)

        results = vllm.run(kill_mid_run())
        failed = [r for r in results if isinstance(r, BaseException)]
        assert failed and all(isinstance(r, EnvProcessError) and not isinstance(r, PROGRAMMING_ERRORS)
                              for r in failed)
        assert "exited with status -9" in str(failed[0]) and "verifiers env 'vf_arith'" in str(failed[0])
        groups = collect(samples, results)  # as the scheduler does: FAILED with the reason, counted
        flat = [s for g in groups for s in g]
        assert sum(s.status == Status.FAILED for s in flat) == len(failed)
        assert all("exited with status -9" in s.error for s in flat if s.status == Status.FAILED)
        # the next rollout restarts the worker
        again = vllm.run(agent.rollout(samples[0]))
        assert again and agent.agent.worker.starts == 2
    finally:
        vllm.run(agent.aclose())


def test_bad_environments_fail_in_one_line():
    require_venv()
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    from rlexp.errors import ConfigError

    cases = {
        "data.source.env_id=no_such_env":
            "verifiers env 'no_such_env' cannot be loaded: ModuleNotFoundError: taskset 'no_such_env'",
        "data.source.env_args={agent: {runtime: {type: prime}}}": "needs a sandbox",
        "data.source.env_args={id: best-of-n}": "is not SingleAgentEnv",
        f"data.source.python={ROOT}/.venv-nope/bin/python": "run `make envs`",
        "data.source.python=.venv-nope/bin/python": "or set data.source.python=/path/to/venv/bin/python",
    }
    for override, expected in cases.items():
        with pytest.raises(InstantiationException) as e:
            instantiate(_cfg(override).data.source)
        error = e.value.__cause__  # what preflight reports (rlexp.preflight.load_inputs)
        assert isinstance(error, ConfigError) and expected in str(error) and "\n" not in str(error), override


def test_an_env_missing_a_package_names_it(tmp_path):
    """verifiers reports the env as not found; the package it needs is the cause, in the line."""
    require_venv()
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    (tmp_path / "needs_pkg_env.py").write_text("import verifiers.v1 as vf\nimport rlexp_no_such_package\n")
    with pytest.raises(InstantiationException) as e:
        instantiate(_cfg("data.source.env_id=needs_pkg_env", f"data.source.paths=[{tmp_path}]").data.source)
    error = str(e.value.__cause__)
    assert "taskset 'needs_pkg_env' not found" in error and "\n" not in error
    assert "caused by ModuleNotFoundError: No module named 'rlexp_no_such_package'" in error


def test_the_defaults_work_from_another_directory(tmp_path, monkeypatch):
    """The env venv's Python and the examples' directory are the checkout's, wherever the run starts."""
    require_venv()
    from hydra.utils import instantiate

    monkeypatch.chdir(tmp_path)
    cfg = _cfg(f"data.source.env_args={SMALL}", defaults=True)
    assert cfg.agent.python == cfg.data.source.python == str(VENV_PYTHON)
    source = instantiate(cfg.data.source)  # vf_arith, from examples/environments
    assert source.info["env_id"] == "vf_arith"
    assert len(source.problems("train")) + len(source.problems("eval")) == 890


def test_a_broken_env_stops_the_run_in_preflight(tmp_path):
    """Before any engine starts: one line on stderr, exit status 2 (run from another directory:
    the env venv's Python is found all the same)."""
    require_venv()
    broken = tmp_path / "broken_env.py"
    broken.write_text("import verifiers.v1 as vf\nraise RuntimeError('the env is broken')\n")
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "rlexp.run", "agent=verifiers", "data=verifiers",
                          "data.source.env_id=broken_env", f"data.source.paths=[{tmp_path}]",
                          f"hydra.run.dir={tmp_path}/out"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert ("rlexp: config error: data.source: verifiers env 'broken_env' cannot be loaded: "
            "RuntimeError: the env is broken") in res.stderr
    assert "vllm" not in res.stderr.lower() and time.monotonic() - t0 < 120


@pytest.mark.slow
def test_whole_run(tmp_path, run_models):
    require_venv()
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", "experiment=verifiers", "trainer.total_steps=2",
           f"logger.tracking_uri={uri}", f"logger.artifact_location={tmp_path}/artifacts",
           "logger.experiment_name=test", f"model.cache_dir={run_models}", "model.warm_start_steps=40",
           f"hydra.run.dir={tmp_path}/out", "data.prompts_per_step=2", "data.samples_per_prompt=2",
           "evaluator.prompts=4", "evaluator.every_n_steps=2"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path,  # not the checkout
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    rewards = client.get_metric_history(run.info.run_id, "rollout/reward_mean")
    assert [m.step for m in rewards] == [1, 2]
    assert "verifiers/reward/correct_mean" in run.data.metrics and "eval/accuracy" in run.data.metrics
    assert run.data.metrics["samples/failed"] == 0
    # each trace line names its task (re-scored by index and split, not by its prompt's text)
    trace_file = client.download_artifacts(run.info.run_id, "traces/step_00001.jsonl", str(tmp_path))
    lines = [json.loads(line) for line in Path(trace_file).read_text().splitlines()]
    assert len(lines) == 4 and all(line["metadata"]["task_split"] == "train" for line in lines)
    assert all(isinstance(line["metadata"]["task_index"], int) and "trace_id" in line["metadata"]["verifiers"]
               for line in lines)
