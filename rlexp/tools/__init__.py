"""Tools an agent can call, by the names `agent.tools` uses."""

from __future__ import annotations

from typing import Any


def tool_classes() -> dict[str, Any]:
    from rlexp.tools.calculator import Calculator
    from rlexp.tools.python_sandbox import PythonExpression

    return {"calculator": Calculator, "python": PythonExpression}


def tool_specs(names) -> list[dict[str, Any]]:
    """The OpenAI specs of the named tools (unknown names are the agent's to report)."""
    classes = tool_classes()
    return [classes[n].spec for n in names if n in classes]
