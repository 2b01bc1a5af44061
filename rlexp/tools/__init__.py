"""Tools an agent can call, by the names `agent.tools` uses: the one registry of them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rlexp.protocols import Tool


def tool_classes() -> dict[str, Any]:
    """Name -> class; every class is built with `timeout_s` (the longest one call may run)."""
    from rlexp.tools.calculator import Calculator
    from rlexp.tools.python_sandbox import PythonExpression
    from rlexp.tools.zoom import Zoom

    return {"calculator": Calculator, "python": PythonExpression, "zoom": Zoom}


def build_tools(names: Iterable[str], timeout_s: float) -> dict[str, Tool]:
    """The named tools, by name; an unknown name is a ValueError listing the known ones."""
    classes, names = tool_classes(), list(names)
    unknown = sorted(set(names) - set(classes))
    if unknown:
        raise ValueError(f"agent.tools: unknown tool(s) {unknown}; have {sorted(classes)}")
    return {name: classes[name](timeout_s=timeout_s) for name in names}


def tool_specs(names) -> list[dict[str, Any]]:
    """The OpenAI specs of the named tools (unknown names are the agent's to report)."""
    classes = tool_classes()
    return [classes[n].spec for n in names if n in classes]
