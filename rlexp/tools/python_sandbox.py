"""A sandboxed Python-expression tool: each call runs in a fresh, isolated interpreter
with CPU-time, memory and file-descriptor limits, only math builtins, and an audit hook
that refuses file, socket, process and import events. A call past `timeout_s` is killed."""

from __future__ import annotations

import asyncio
import json
import resource
import sys

from rlexp.tools.spec import expression_tool_spec

_CHILD = r"""
import math, sys
_exec_left = [1]  # the one eval below
def _deny(event, args):
    if event == "exec" and _exec_left[0]:
        _exec_left[0] -= 1
        return
    if event == "open" or event.split(".")[0] in ("socket", "subprocess", "os", "shutil", "ctypes") \
            or event in ("import", "exec", "compile", "builtins.input", "urllib.Request"):
        raise PermissionError(f"sandbox: {event} is not allowed")
expr = sys.stdin.read()
safe = {k: getattr(math, k) for k in dir(math) if not k.startswith("_")}
safe.update(abs=abs, min=min, max=max, sum=sum, round=round, len=len, range=range, int=int,
            float=float, str=str, list=list, sorted=sorted, pow=pow, divmod=divmod, all=all, any=any)
code = compile(expr, "<tool>", "eval")
sys.addaudithook(_deny)
print(repr(eval(code, {"__builtins__": safe}, {})))
"""


def _limits(memory_mb: int, cpu_s: int):
    def apply():
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    return apply


async def run_sandboxed(expression: str, timeout_s: float = 2.0, memory_mb: int = 256) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", _CHILD, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={},
        preexec_fn=_limits(memory_mb, max(1, int(timeout_s) + 1)))
    try:
        out, err = await asyncio.wait_for(proc.communicate(expression.encode()), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        return f"error: timed out after {timeout_s}s"
    if proc.returncode != 0:
        last = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        return f"error: {last[0][:300]}"
    return out.decode(errors="replace").strip()[:1000]


class PythonExpression:
    name = "python"
    spec = expression_tool_spec("python", "Evaluate one Python expression (math functions only).")

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 256):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    async def __call__(self, arguments: str) -> str:
        expression = str(json.loads(arguments)["expression"])
        return await run_sandboxed(expression, self.timeout_s, self.memory_mb)
