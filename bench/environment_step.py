"""A training step whose environment is an OpenEnv server process over the same step with the
same game played in process, on the default experiment's model and task, in one run.

    .venv/bin/python bench/environment_step.py [--steps 4 --blocks 2] [overrides applied to both ...]

Both sides are rlexp's own loop (`RLLoop`, vLLM, GRPO trainer, MLflow) driving the tool loop
of agent=tool (rlexp/agents/tool.py `converse`) through agent=environment, on the same
prompts, seeds, sampling and sizes:
- openenv: agent=openenv, examples/environments/openenv_guess.py served by OpenEnv's own
  server from .venv-openenv (`make envs`), one WebSocket session per rollout;
- inprocess: agent=environment with `InProcessGuess` below, the same game (same feedback,
  reward and end) as a plain class in rlexp's process.
Every reply is a guess (`tool_choice=required`, guided decoding), so the two sides generate
the same tokens and differ only in where the environment runs. Blocks alternate the sides so
both meet the same machine; the first 2 steps of each block are warm-up. The server's start
is outside the steps (the agent is built before the first). Headline: median openenv step /
median in-process step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
MAX_GUESSES = 3
# the default experiment, smaller (each reply is a ~90-token tool call on a character-level model)
SHARED = ["data.prompts_per_step=8", "data.samples_per_prompt=4", "rollout.max_response_tokens=112",
          "rollout.max_model_len=512", "agent.tool_choice=required", "agent.max_turns=3",
          "agent.max_tool_calls=3", "logger.log_traces=false"]
SIDES = {
    "openenv": ["agent=openenv", "agent.environment=examples.environments.openenv_guess:GuessEnvironment",
                f"agent.python={ROOT / '.venv-openenv/bin/python'}", "agent.tool_name=calculator", *SHARED],
    "inprocess": ["agent=environment", "agent.factory=environment_step:InProcessGuess", *SHARED],
}


class InProcessGuess:
    """examples/environments/openenv_guess.py's game as a plain class: the same tool spec,
    feedback, reward and end."""

    def __init__(self):
        self.target, self.guesses, self.reward, self.done = 0, 0, 0.0, False
        self.tool_schemas = {"guess": {"type": "function", "function": {
            "name": "calculator", "description": "Guess the hidden number.",
            "parameters": {"type": "object", "required": ["expression"], "properties": {"expression": {
                "description": "the guess: an integer, or +, - and * of integers (e.g. 12+34)",
                "pattern": "^[0-9+*-]{1,12}$", "title": "Expression", "type": "string"}}}}}}

    def reset(self, answer: str, **row) -> None:
        self.target, self.guesses, self.reward, self.done = int(answer), 0, 0.0, False

    def guess(self, expression: str) -> str:
        import re

        from examples.environments.counter_env import evaluate

        if not re.fullmatch(r"[0-9+*-]{1,12}", expression):  # OpenEnv's server validates the Action first
            raise ValueError("Invalid message: expression: String should match pattern '^[0-9+*-]{1,12}$'")
        self.guesses += 1
        left = MAX_GUESSES - self.guesses
        try:
            value = evaluate(expression)
        except (ValueError, SyntaxError) as e:
            self.done = left <= 0
            return f"invalid guess ({e}); {left} left"
        if value == self.target:
            self.reward, self.done = 1.0, True
            return f"{value} is right"
        self.done = left <= 0
        return f"{value} is {'too low' if value < self.target else 'too high'}; {left} left"


def main() -> None:
    from common import two_sided_medians

    if not (ROOT / ".venv-openenv/bin/python").is_file():
        sys.exit(".venv-openenv is missing: run `make envs` (scripts/install_envs.sh openenv)")
    sys.path.insert(0, str(ROOT))  # examples.environments, in the child blocks too
    med = two_sided_medians(__doc__, __file__, SIDES)
    if med is None:  # a child block
        return
    o, i = med["openenv"], med["inprocess"]
    print(f"produce openenv/inprocess: {o['produce'] / i['produce']:.3f}   "
          f"response tokens: {o['tokens']:.1f} vs {i['tokens']:.1f}")
    print(f"ratio: {o['step'] / i['step']:.3f}")


if __name__ == "__main__":
    main()
