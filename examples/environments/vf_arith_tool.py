"""A multi-turn verifiers (0.4) environment with a tool: the arithmetic of vf_arith.py, with
a `calculator` tool (an MCP tool server, verifiers' `Toolset`) the model may call before it
answers. The conversation is: the question, the model's tool call, the tool's result, the
model's answer; rlexp's tiny model warm-started with `model.warm_start_format=tool` calls
the tool exactly so (`<tool_call>{"name": "calculator", ...}</tool_call>`).

Rewards: `correct` (1.0 when the last reply is the answer); metric `tool_calls`.

The tool server is the taskset's (`Taskset.toolsets`): one server for every episode, started
once, as `python -m vf_arith_tool` (so this module must be importable by the worker's Python:
rlexp puts data.source.paths on its PYTHONPATH). No `from __future__ import annotations`
here: MCP reads the tool's annotations (the argument's pattern) at run time."""

import re
from typing import Annotated

import verifiers.v1 as vf
from pydantic import Field
from vf_arith import ArithConfig, ArithData, problems, score

# The argument's schema says what a call may hold: a policy whose calls are constrained to
# the schema (rlexp's structured outputs under tool_choice=required) writes a short one.
PATTERN = r"^-?\d{1,4}[-+*]-?\d{1,4}$"
_EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")


class Calculator(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is `calculator`, not `calculator_calculator`

    @vf.tool
    async def calculator(self, expression: Annotated[str, Field(pattern=PATTERN)]) -> str:
        """Evaluate an arithmetic expression of two integers, such as 12+34."""
        m = _EXPRESSION.match(expression)
        if not m:
            return f"error: {expression!r} is not <integer><+|-|*><integer>"
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        return str(a + b if op == "+" else a - b if op == "-" else a * b)


class ArithToolTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        return score(trace.last_reply, self.data.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        """The calls the model made (a call in the last turn gets no result back)."""
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))


class ArithToolConfig(ArithConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class ArithToolTaskset(vf.Taskset[ArithToolTask, ArithToolConfig]):
    def load(self) -> list[ArithToolTask]:
        return [ArithToolTask(ArithData(prompt=q, answer=a, name=q), self.config.task)
                for q, a in problems(self.config)]

    @classmethod
    def toolsets(cls, config: ArithToolConfig) -> list[vf.Toolset]:
        return [Calculator(config.tools)]


__all__ = ["ArithToolTaskset"]

if __name__ == "__main__":  # the tool server's process (verifiers starts it)
    Calculator.run()
