"""agent=openenv: the lifetime and faults of an OpenEnv server (OpenEnv's own server, in its
own venv), each test with a server of its own or none: one that does not start, one killed
mid-run, rlexp killed, and a whole run, which starts one server and leaves none behind.

These tests need .venv-openenv (`make envs`); without it they fail, saying so (the
`openenv_python` fixture, tests/conftest.py)."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from rlexp.agents.environment import EnvironmentAgent
from rlexp.envs.openenv import OpenEnvEnvironment
from rlexp.envs.openenv_server import OpenEnvServer
from rlexp.errors import ConfigError
from rlexp.guards import AgentGuard
from rlexp.judges.math_exact import MathExactJudge
from rlexp.loop import build_guarded
from rlexp.sample import Status
from rlexp.schedulers.sync import collect
from tests.environment_helpers import CONF, GUESS, ROOT, SESSIONS, _call, _openenv_agent, _running, _task
from tests.fakes import ScriptedEngine


def test_a_server_that_does_not_start_is_a_one_line_error(tokenizer, openenv_python, tmp_path):
    with pytest.raises(ConfigError) as e:
        OpenEnvServer("examples.environments.no_such_env:Env", openenv_python, start_timeout_s=120).start()
    message = str(e.value)
    assert "did not start: ModuleNotFoundError: No module named 'examples.environments.no_such_env'" \
        in message
    assert "\n" not in message
    with pytest.raises(ConfigError, match="make envs") as e:
        _openenv_agent(ScriptedEngine(tokenizer, []), tokenizer, str(tmp_path / "no-venv/bin/python"))
    assert "\n" not in str(e.value)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):  # built as a run builds it
        cfg = compose("config", overrides=["agent=openenv", f"agent.environment={GUESS}",
                                           f"agent.python={tmp_path / 'no-venv/bin/python'}"])
    with pytest.raises(ConfigError, match="make envs"):  # its one line, not Hydra's wrapper
        build_guarded(cfg, "agent", AgentGuard, engine=ScriptedEngine(tokenizer, []), tokenizer=tokenizer,
                      judge=MathExactJudge())


def test_a_server_killed_mid_run_fails_the_rollouts_it_held_then_restarts(tokenizer, openenv_python):
    server = OpenEnvServer(GUESS, openenv_python, max_sessions=SESSIONS, max_restarts=1, step_timeout_s=30)
    server.start()
    gate = asyncio.Event()

    class GatedEngine(ScriptedEngine):
        async def generate(self, token_ids, sampling, images=None):
            await gate.wait()
            self.replies = [_call("calculator", expression="12+34")]
            return await super().generate(token_ids, sampling, images)

    engine = GatedEngine(tokenizer, [])
    agent = EnvironmentAgent(engine, tokenizer, MathExactJudge(),
                             partial(OpenEnvEnvironment, server, "calculator"))
    samples = [_task(uid=i) for i in range(3)]

    async def go():
        tasks = [asyncio.create_task(AgentGuard(agent).rollout(s)) for s in samples]
        while server.proc is None or not server.alive():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)  # every rollout holds its session, waiting for its reply
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait()
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        (failed,) = collect(samples, results)
        after = await agent.rollout(_task(uid=9))  # the server is started again for it
        await server.aclose_idle()
        return failed, after

    try:
        started = time.monotonic()
        failed, (after,) = asyncio.run(asyncio.wait_for(go(), 120))
    finally:
        server.stop()
    assert time.monotonic() - started < 90  # never a hang
    assert [s.status for s in failed] == [Status.FAILED] * 3
    assert all("session failed" in s.error and "exited with code -9" in s.error for s in failed), \
        failed[0].error
    assert server.restarts == 1 and after.status == Status.COMPLETED and after.reward == 1.0


CHILD = """
import sys, time
from rlexp.envs.openenv_server import OpenEnvServer
server = OpenEnvServer(sys.argv[1], sys.argv[2])
server.start()
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def test_the_server_exits_when_rlexp_is_killed(openenv_python):
    parent = subprocess.Popen([sys.executable, "-c", CHILD, GUESS, openenv_python], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    try:
        pid = int(parent.stdout.readline())
    finally:
        parent.kill()  # SIGKILL: no cleanup runs in rlexp
        parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.1)
    assert not _running(pid), f"the OpenEnv server (pid {pid}) outlived a killed rlexp"


@pytest.mark.slow
@pytest.mark.vllm
def test_a_whole_run_with_an_openenv_environment(tmp_path, tiny_model_path, openenv_python):
    from mlflow.tracking import MlflowClient

    from tests.conftest import TINY_KW

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    model = [f"model.{k}={v}" for k, v in TINY_KW.items() if not k.startswith("task_")]
    cmd = [sys.executable, "-m", "rlexp.run", "agent=openenv", f"agent.environment={GUESS}",
           f"agent.python={openenv_python}", "agent.tool_name=calculator", "agent.tool_choice=required",
           "agent.max_turns=2", "trainer.total_steps=2", "data.prompts_per_step=4",
           "data.samples_per_prompt=2",
           "data.source.max_operand=29", "evaluator.prompts=8", "evaluator.every_n_steps=2",
           "rollout.max_response_tokens=112", "rollout.max_model_len=512", "checkpoint.every_n_steps=0",
           f"model.cache_dir={Path(tiny_model_path).parent}", *model, f"logger.tracking_uri={uri}",
           f"logger.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/out"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlexp").experiment_id])
    assert run.info.status == "FINISHED" and "eval/accuracy" in run.data.metrics
    assert run.data.metrics["samples/failed_frac"] == 0.0
    log = res.stdout + res.stderr
    started = [line for line in log.splitlines() if "OpenEnv server for" in line and ": pid " in line]
    assert len(started) == 1, log[-3000:]  # one server for the run: training and evaluation share it
    pid = int(started[0].split(": pid ")[1].split()[0])
    assert not _running(pid)  # gone with the run
