"""Calculator tool: arithmetic over numbers with + - * / // % ** and parentheses (no eval)."""

from __future__ import annotations

import ast
import json
import operator

from rlexp.tools.spec import expression_tool_spec

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float | int:
    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element: {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    return ev(ast.parse(expression, mode="eval").body)


class Calculator:
    name = "calculator"
    reads_images = False
    spec = expression_tool_spec("calculator", "Evaluate an arithmetic expression.")

    def __init__(self, timeout_s: float = 2.0):
        """`timeout_s` is taken as every tool takes it; a calculation is bounded by the
        expression's length and exponent limits instead."""
        self.timeout_s = timeout_s

    async def __call__(self, arguments: str) -> str:
        args = json.loads(arguments)
        value = calculate(str(args["expression"]))
        return str(int(value) if isinstance(value, float) and value.is_integer() else value)
