"""A sandboxed Python-expression tool: each call runs in a fresh, isolated interpreter
with CPU-time, memory and file-descriptor limits, only math builtins, and an audit hook
that refuses file, socket, process and import events. A call past `timeout_s` is killed.

The child sets its own resource limits as its first statements, before it reads the
expression. They are not set with `preexec_fn`: that runs Python in the forked child of a
process that has threads (fit runs in a thread, MLflow logs from threads), which CPython
documents as able to deadlock."""

from __future__ import annotations

import asyncio
import json
import sys

from rlexp.tools.spec import expression_tool_spec

_CHILD = r"""
import resource, sys
_memory_b, _cpu_s = int(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (_memory_b, _memory_b))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu_s, _cpu_s))
resource.setrlimit(resource.RLIMIT_NOFILE, (16, 16))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
import math
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


async def run_sandboxed(expression: str, timeout_s: float = 2.0, memory_mb: int = 256) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-I", "-S", "-c", _CHILD, str(memory_mb << 20), str(max(1, int(timeout_s) + 1)),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={})
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
    reads_images = False
    spec = expression_tool_spec("python", "Evaluate one Python expression (math functions only).")

    def __init__(self, timeout_s: float = 2.0, memory_mb: int = 256):
        self.timeout_s, self.memory_mb = timeout_s, memory_mb

    async def __call__(self, arguments: str) -> str:
        expression = str(json.loads(arguments)["expression"])
        return await run_sandboxed(expression, self.timeout_s, self.memory_mb)
