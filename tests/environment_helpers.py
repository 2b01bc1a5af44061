"""What the environment tests share (tests/test_environments.py, test_openenv_server.py,
test_environments_vllm.py): the paths, the OpenEnv example environment and its server settings,
tool calls and tasks as the agents see them, and an OpenEnv agent built with those settings."""

import json
from pathlib import Path

from rlexp.agents.environment import OpenEnvAgent
from rlexp.judges.math_exact import MathExactJudge
from rlexp.sample import Sample

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
GUESS = "examples.environments.openenv_guess:GuessEnvironment"
SESSIONS = 4  # the OpenEnv servers of the tests: episodes at once
SERVER_KW = dict(max_sessions=SESSIONS, start_timeout_s=120.0, step_timeout_s=60.0, max_restarts=3)


def _call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def _task(answer="46", uid=0):
    return Sample(group_id=0, prompt=[{"role": "user", "content": "12+34="}], answer=answer,
                  uid=uid, metadata={"seed": 1 + uid})


def _openenv_agent(engine, tokenizer, python, **kw):
    return OpenEnvAgent(engine, tokenizer, MathExactJudge(), GUESS, python=python, tool_name="calculator",
                        **{k: v for k, v in SERVER_KW.items() if k not in kw}, **kw)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
