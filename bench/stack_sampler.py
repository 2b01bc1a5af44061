"""A wall-clock sampler of this process's Python stacks, for attributing a step's time.

    sampler = StackSampler(interval=0.004)
    sampler.start()
    sampler.phase("produce") ... sampler.phase("fit") ... sampler.phase(None)  # None: not timed
    sampler.stop(); sampler.cells  # {(phase, category): seconds}

Every `interval` a daemon thread reads every thread's stack (`sys._current_frames`) and gives
the time since its last sample to one (phase, category) cell, so the cells of a phase add up
to that phase's wall time exactly. The category is the step's thread's: the main thread's,
or, while the main thread only waits (an event loop in `select`, a lock, a queue), the pool
thread doing the work it waits on (the trainer's fit runs in `asyncio.to_thread`; `AWAITED`). A thread works
when its innermost Python frame is not a wait and it ran on a CPU since it was last asked
(/proc's schedstat: a thread blocked in a C call shows the frame that made the call); when no
thread of this process works, the time is `idle`: the process waits on another one (vLLM's
engine core generating or reloading). Threads that work beside the step's thread are added
to `beside` (thread-seconds by category): CPU they take from the machine, off the step's path.

At each phase change the sampler also adds the CPU seconds the process's children used
(vLLM's engine core, and its worker where that has a process of its own) to `children_cpu`,
so the engine's busy share of a phase is children_cpu / wall.

A category is the innermost frame's library: the first rule of `RULES` that matches a frame,
innermost frame first, so rlexp code calling torch counts as torch, MLflow's store calling
SQLAlchemy as MLflow logging, rlexp's judge calling `re` as the judge.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import FrameType

import psutil

RULES = (  # (path fragment, category); the first to match a frame, innermost first
    ("/mlflow/", "MLflow logging"), ("/sqlalchemy/", "MLflow logging"), ("/alembic/", "MLflow logging"),
    ("rlexp/tracking/", "traces, tracker"), ("rlexp/judges/", "judge"),
    ("vllm/v1/engine/output_processor", "vLLM output processing"),
    ("vllm/v1/engine/detokenizer", "vLLM output processing"),
    ("vllm/v1/engine/logprobs", "vLLM output processing"),
    ("vllm/outputs", "vLLM output processing"),
    ("vllm/sampling_params", "vLLM request building"),
    ("vllm/v1/engine/input_processor", "vLLM request building"),
    ("vllm/v1/engine/processor", "vLLM request building"),
    ("/msgspec/", "serialisation"), ("/zmq/", "serialisation"), ("/pickle", "serialisation"),
    ("vllm/", "vLLM client, other"), ("/safetensors/", "weight write"), ("rlexp/weights/", "weight write"),
    ("/tokenizers/", "tokenizer"), ("transformers/tokenization", "tokenizer"),
    ("/torch/", "torch"), ("/transformers/", "torch"),
    ("rlexp/trainer/", "trainer Python"), ("rlexp/algorithms/", "trainer Python"),
    ("rlexp/agents/", "agent"), ("rlexp/schedulers/", "scheduler"), ("rlexp/rollout/", "rlexp engine"),
    ("rlexp/data/", "data"), ("rlexp/", "rlexp, other"),
    ("/asyncio/", "asyncio"), ("/logging/", "logging module"),
    ("step_vs_naive.py", "naive loop Python"),
)
WAITS = {("selectors.py", "select"), ("threading.py", "wait"), ("threading.py", "_wait_for_tstate_lock"),
         ("threading.py", "join"), ("queue.py", "get"), ("thread.py", "_worker"),
         ("socket.py", "recv_multipart"), ("socket.py", "recv"), ("socket.py", "poll"), ("poll.py", "poll"),
         ("connection.py", "_recv")}

# The threads of pools a step awaits (`asyncio.to_thread`, an executor without a name of its
# own); a named pool (rlexp's trace writer, MLflow's async logging) works beside the step.
AWAITED = ("asyncio_", "ThreadPoolExecutor-")


def stack(frame: FrameType | None) -> list[tuple[str, str]]:
    """(file, function) of each frame, innermost first."""
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_code.co_name))
        frame = frame.f_back
    return out


def waiting(frames: list[tuple[str, str]]) -> bool:
    if not frames:
        return True
    path, func = frames[0]
    return (path.rsplit("/", 1)[-1], func) in WAITS or func in ("sleep", "select", "poll", "epoll")


def category(frames: list[tuple[str, str]]) -> str:
    return where(frames)[0]


def where(frames: list[tuple[str, str]]) -> tuple[str, str]:
    """(category, site): the site is the frame that decided the category and the nearest
    rlexp (or bench) frame that led to it, as file:function."""
    def short(frame: tuple[str, str]) -> str:
        return f"{frame[0].rsplit('/', 1)[-1]}:{frame[1]}"

    for i, frame in enumerate(frames):
        for fragment, name in RULES:
            if fragment in frame[0]:
                caller = next((f for f in frames[i:] if "rlexp/" in f[0] or "/bench/" in f[0]), None)
                site = short(frame) if caller in (None, frame) else f"{short(frame)} < {short(caller)}"
                return name, site
    return "other", short(frames[0]) if frames else "?"


class StackSampler:
    def __init__(self, interval: float = 0.004):
        self.interval = interval
        self.cells: dict[tuple[str, str], float] = defaultdict(float)
        self.beside: dict[str, float] = defaultdict(float)
        self.sites: dict[tuple[str, str, str], float] = defaultdict(float)  # (phase, category, site)
        self.children_cpu: dict[str, float] = defaultdict(float)
        self.samples = 0
        self._changes: list[tuple[float, str | None]] = []  # (when, phase), appended by `phase`
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._me = psutil.Process()
        self._ran: dict[int, tuple[int, float]] = {}  # thread -> (run ns, when read)

    def start(self) -> None:
        self._thread.start()

    def phase(self, name: str | None) -> float:
        """The step's phase from now on; None stops the clock (warm-up, the end). The change is
        timed here, by the caller: the sampler thread may wait for the GIL for a while. Returns
        the time of the change (`time.perf_counter`)."""
        when = time.perf_counter()
        self._changes.append((when, name))
        return when

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _children_cpu(self) -> float:
        total = 0.0
        for child in self._me.children(recursive=True):
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def _run(self) -> None:
        main, mine = threading.main_thread().ident, threading.get_ident()
        last, phase, cpu, seen = time.perf_counter(), None, self._children_cpu(), 0
        stopped = False
        while not stopped:  # after `stop`, one last pass: the changes up to it are counted
            stopped = self._stop.wait(self.interval)
            now = time.perf_counter()
            spans, start = [], last  # the interval since the last sample, split at phase changes
            for when, name in self._changes[seen:]:
                if when > now:
                    break
                spans.append((phase, when - start))
                start, phase, seen = when, name, seen + 1
                cpu_now = self._children_cpu()
                if spans[-1][0] is not None:
                    self.children_cpu[spans[-1][0]] += cpu_now - cpu
                cpu = cpu_now
            spans.append((phase, now - start))
            if any(p is not None for p, _ in spans):
                self._sample([(p, dt) for p, dt in spans if p is not None], main, mine)
            last = now

    def _on_cpu(self, ident: int, native: dict[int, int | None]) -> bool:
        """Whether the thread ran on a CPU for at least 5% of the time since it was last
        asked (its scheduler run time, /proc/self/task/<tid>/schedstat): a thread blocked in a
        C call (`time.sleep`, a lock, a socket) shows the Python frame that made the call."""
        tid = native.get(ident)
        if tid is None:
            return True
        try:
            run_ns = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except OSError:
            return True
        now = time.perf_counter()
        last_ns, last_t = self._ran.get(ident, (run_ns, now - self.interval))
        self._ran[ident] = (run_ns, now)
        return (run_ns - last_ns) * 1e-9 >= 0.05 * (now - last_t)

    def _sample(self, spans: list[tuple[str, float]], main: int | None, mine: int) -> None:
        """The threads' state now, given to each (phase, seconds) span of the last interval."""
        frames = {tid: stack(f) for tid, f in sys._current_frames().items() if tid != mine}
        threads = [t for t in threading.enumerate() if t.ident is not None]
        native = {t.ident: t.native_id for t in threads}
        names = {t.ident: t.name for t in threads}
        busy = {tid: fr for tid, fr in frames.items() if not waiting(fr) and self._on_cpu(tid, native)}
        awaited = {tid for tid, name in names.items() if name.startswith(AWAITED)}
        step_thread = main if main in busy else next((tid for tid in busy if tid in awaited), None)
        cat, site = where(busy[step_thread]) if step_thread is not None else ("idle", "")
        for phase, dt in spans:
            self.cells[(phase, cat)] += dt
            self.sites[(phase, cat, site)] += dt
            for tid, fr in busy.items():
                if tid != step_thread:
                    beside_cat, beside_site = where(fr)
                    self.beside[beside_cat] += dt
                    self.sites[("beside", beside_cat, beside_site)] += dt
        self.samples += 1
