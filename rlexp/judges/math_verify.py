"""Math judge on math-verify (`math_verify`, HuggingFace's answer-equivalence library): the
final answer of the response is extracted and checked for equivalence with the reference
(a GSM8K number "72" or LaTeX "\\frac{1}{2}"), so "0.5" = "\\frac{1}{2}", "$\\boxed{\\frac{3}{4}}$"
= "0.75", "1,234" = "1234", "18 dollars" = "18", "\\sqrt{8}" = "2\\sqrt{2}".

Extraction rules (`metadata["judge_rule"]`, and one-hot `reward_components["rule_<name>"]`):

    gsm8k   the first line after the last `####` (GSM8K's format, which math-verify does not
            know), read with the rules below (if it holds no answer, the whole response is)
    boxed   a `\\boxed{...}`, alone or inside a LaTeX environment
    answer  a LaTeX or plain answer anchored by "final answer is" / "answer:" / "answer ..."
    latex   plain LaTeX: `$...$`, `$$...$$`, `\\(...\\)`, `\\[...\\]`, a bare `\\frac{a}{b}`
    expr    a plain expression with an operator: `3/4`, `2*5+1`
    number  a plain number: `1,234.5`, `$18`, `25%` (thousands separators, currency, percent)

Apart from gsm8k they are math-verify's own extraction patterns (math_verify.parser), tried in
its order: the "final answer is X. I hope" pattern, then `\\boxed` and "final answer ... is X",
then "answer: X", "answer ... X", then plain LaTeX / expression / number; within one tier the
last match in the text wins. The rule is read off the pattern that matched (its tier and its
named groups). A match that sympy cannot parse is still an answer (format 1), compared as a
string. Equivalence is `math_verify.verify`: numeric to 6 decimals, then symbolic (sympy).

Timeouts: math-verify's own (`signal.alarm`: main thread only) are off (None); rlexp's guard
bounds a call (`judge.guard.timeout_s`, 10 s in conf/judge/math.yaml). The sympy work runs in
worker processes, not in a thread: an answer like `\\boxed{9^{9^{9}}}` makes sympy compute a
huge power in C, holding the GIL for hours, which froze the event loop (guard's timer
included) under `asyncio.to_thread` too. A worker whose call is cancelled (the guard's
timeout) is killed and replaced. Measured per call: 1-10 ms (a 2,500-character response
~8 ms), 0.1-1 s for the first check of a symbolic answer (sqrt, polynomials, intervals); a
fresh worker takes 1.5-2.5 s to start."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import weakref
from functools import lru_cache
from itertools import groupby
from pathlib import Path
from typing import Any

from rlexp.constraints import AtLeast1
from rlexp.protocols import Judge
from rlexp.sample import Sample

RULES = ("gsm8k", "boxed", "answer", "latex", "expr", "number")
_PLAIN = 300  # math-verify's priority of the unanchored patterns (lower = tried first)


class MathVerifyJudge(Judge):
    """reward = correct_reward * [answer equivalent to reference] + format_reward * [an answer
    was found]. `workers`: processes doing the sympy work (started as needed, ~60 MB each)."""

    def __init__(self, correct_reward: float = 1.0, format_reward: float = 0.0, workers: AtLeast1 = 4):
        self.correct_reward = correct_reward
        self.format_reward = format_reward
        self.workers = workers
        self._idle: list[_Worker] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._slots = asyncio.Semaphore(workers)
        weakref.finalize(self, _kill_all, self._idle)

    async def score(self, sample: Sample) -> Sample:
        reply = await self._call({"response": sample.response_text, "answer": sample.answer})
        if "error" in reply:
            raise RuntimeError(reply["error"])
        rule = reply["rule"]
        correct, found = float(reply["correct"]), float(rule is not None)
        sample.reward_components = {"correct": correct, "format": found}
        sample.reward_components |= {f"rule_{r}": float(r == rule) for r in RULES}
        sample.reward = self.correct_reward * correct + self.format_reward * found
        sample.metadata["judge_rule"] = rule
        sample.metadata["predicted"] = reply["predicted"]
        return sample

    async def _call(self, request: dict[str, str]) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a semaphore belongs to one loop; the workers to none
            self._loop, self._slots = loop, asyncio.Semaphore(self.workers)
        async with self._slots:
            worker = None
            while self._idle and worker is None:
                worker = self._idle.pop()
                if not worker.alive():
                    worker.kill()
                    worker = None
            worker = worker or _Worker()
            try:
                reply = await worker.call(request)
            except BaseException:  # cancelled (the guard's timeout) or broken: may be mid-computation
                worker.kill()
                raise
            self._idle.append(worker)
            return reply


class _Worker:
    """A process running `serve`: one JSON request a line on its stdin, one reply a line."""

    def __init__(self) -> None:
        root = str(Path(__file__).resolve().parents[2])  # where `rlexp` is, if not installed
        boot = "import sys; sys.path.append(sys.argv[1]); from rlexp.judges.math_verify import serve; serve()"
        self.proc = subprocess.Popen([sys.executable, "-c", boot, root, str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def call(self, request: dict[str, str]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        loop, fd, reply = asyncio.get_running_loop(), self.proc.stdout.fileno(), b""
        while not reply.endswith(b"\n"):
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _wake, readable)
            try:
                await readable
            finally:
                loop.remove_reader(fd)
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise RuntimeError(f"math-verify worker exited (code {self.proc.wait()})")
            reply += chunk
        return json.loads(reply)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # the reader may fire again before it is removed
        future.set_result(None)


def _kill_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.kill()
    workers.clear()


def serve() -> None:
    """The worker process's loop (argv: the judge's pid)."""
    with contextlib.suppress(OSError, AttributeError):  # Linux: SIGKILL when the judge's process dies
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, even while stuck in sympy
    if os.getppid() != int(sys.argv[-1]):
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the judge's process's to handle
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what libraries print goes to stderr, not into the replies
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": it is on purpose
    for line in sys.stdin:
        request = json.loads(line)
        try:
            correct, rule, predicted = judge_text(request["response"], request["answer"])
            reply: dict[str, Any] = {"correct": correct, "rule": rule, "predicted": predicted}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


def judge_text(response: str, reference: str) -> tuple[bool, str | None, str | None]:
    """(equivalent, rule, predicted answer); rule and answer None where none was found. Runs
    sympy (in the worker process)."""
    from math_verify import verify

    found = None
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip().split("\n", 1)[0]
        found = extract(tail)
        if found is not None:
            found = (found[0], found[1], "gsm8k")
    found = found or extract(response)
    if found is None:
        return False, None, None
    value, predicted, rule = found
    target = [predicted] if value is None else [value, predicted]
    return bool(verify(_gold(reference), target, timeout_seconds=None)), rule, predicted


def extract(text: str) -> tuple[Any, str, str] | None:
    """(sympy value or None where it does not parse, answer string, rule) of the answer in
    `text`, as math_verify.parser.extract_target_from_pred finds it, or None."""
    from math_verify.parser import extract_match, get_extraction_regexes

    patterns = sorted(((pattern, target, priority)
                       for regexes, target in get_extraction_regexes(_targets())
                       for pattern, priority in regexes), key=lambda p: p[2])
    first = None
    for priority, tier in groupby(patterns, key=lambda p: p[2]):
        matches = sorted(((m, target) for pattern, target, _ in tier for m in pattern.finditer(text)),
                         key=lambda mt: (mt[0].end(), -mt[0].start()), reverse=True)  # last first
        for match, target in matches:
            value, string = extract_match(match, target)
            if value is not None:
                return value, string, _rule(match, target, priority)
            if first is None and string:
                first = (None, string, _rule(match, target, priority))
    return first


def _rule(match, target, priority: int) -> str:
    from math_verify import LatexExtractionConfig

    groups = match.groupdict()
    if isinstance(target, LatexExtractionConfig) and any(
            v and ("latexBoxed" in k or "\\boxed" in v) for k, v in groups.items() if "latex" in k):
        return "boxed"
    if priority < _PLAIN:
        return "answer"
    if isinstance(target, LatexExtractionConfig):
        return "latex"
    return "expr" if groups.get("expr") else "number"


@lru_cache(maxsize=1)
def _targets() -> tuple[Any, ...]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return LatexExtractionConfig(), ExprExtractionConfig()


@lru_cache(maxsize=4096)
def _gold(reference: str) -> list[Any]:
    """The reference parsed as LaTeX (it comes without `$`), else as it is, else its string."""
    from math_verify import parse

    for text in (f"${reference}$", reference):
        gold = parse(text, _targets(), parsing_timeout=None)
        if gold:
            return gold
    return [reference.strip()]
