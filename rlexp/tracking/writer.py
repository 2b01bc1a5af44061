"""A run's MLflow writes during the loop (metrics, trace files, sampled traces), done by a
process of its own.

Why a process: the loop's thread feeds vLLM (a request sent, each engine step's outputs read)
and waits on it in between. Any thread of the same process that runs Python meanwhile (MLflow's
asynchronous logging and trace export, SQLAlchemy, JSON) holds the interpreter's lock for up
to its switch interval (5 ms) each time the loop's thread wants it back: measured on the
default experiment, about 100 ms of such work a step cost the step 125 ms
(docs/benchmarks.md, "Where the step's time goes"). In its own process that work shares no
lock with the loop.

The loop's side (`RunWriter`) pickles each job and hands it to a feeder thread, which writes it
to the process's stdin (the write releases the lock; a full pipe never blocks the loop).
The process (`serve`, `python -m rlexp.tracking.writer`) writes each job into the store in
order; `flush` answers once everything before it is stored, naming every write that failed.
When the loop's process dies, the writer still stores what it received, then exits."""

from __future__ import annotations

import json
import logging
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)
HEADER = struct.Struct("<Q")  # each job's length, then its pickle


class WriterGone(RuntimeError):
    """The writer process exited before answering a flush."""


class RunWriter:
    """The loop's handle on the writer process of run `run_id` (in experiment `experiment_id`
    of the store at `tracking_uri`)."""

    def __init__(self, tracking_uri: str, experiment_id: str, run_id: str):
        self.run_id = run_id
        env = os.environ | {"MLFLOW_ENABLE_ASYNC_TRACE_LOGGING": "false"}  # the process is the background
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rlexp.tracking.writer", tracking_uri, experiment_id, run_id],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._outbox: queue.Queue[bytes | None] = queue.Queue()  # join(): all of it in the pipe
        self._feeder = threading.Thread(target=self._feed, name="rlexp-mlflow-feed", daemon=True)
        self._feeder.start()

    def metrics(self, metrics: dict[str, float], step: int) -> None:
        self._send(("metrics", {k: float(v) for k, v in metrics.items()}, step, int(time.time() * 1000)))

    def traces(self, job: Any) -> None:
        self._send(("traces", job))

    def flush(self) -> None:
        """Return once the process has stored every job sent before; raise naming the writes
        that failed since the last flush, or WriterGone."""
        self._send(("flush",))
        assert self.process.stdout is not None
        answer = self.process.stdout.readline()
        if not answer:
            raise WriterGone(f"the MLflow writer process of run {self.run_id} exited with code "
                             f"{self.process.wait()} (its error is above in the log): what was logged "
                             f"since the last checkpoint may be missing from the run")
        if failed := json.loads(answer):
            raise RuntimeError(f"MLflow writes of run {self.run_id} failed: " + "; ".join(failed))

    def close(self) -> None:
        """Flush, then let the process finish."""
        try:
            self.flush()
        finally:
            self._outbox.put(None)
            self._feeder.join()
            self.process.wait()

    def _send(self, job: tuple) -> None:
        payload = pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL)  # an unpicklable job raises here
        self._outbox.put(payload)

    def _feed(self) -> None:
        assert self.process.stdin is not None
        while (payload := self._outbox.get()) is not None:
            try:
                self.process.stdin.write(HEADER.pack(len(payload)) + payload)
                self.process.stdin.flush()
            except OSError:  # the process is gone: the next flush says so
                self._drop_all()
                return
            finally:
                self._outbox.task_done()
        self._outbox.task_done()
        self.process.stdin.close()

    def _drop_all(self) -> None:
        while True:
            try:
                self._outbox.get_nowait()
            except queue.Empty:
                return
            self._outbox.task_done()


def serve(tracking_uri: str, experiment_id: str, run_id: str) -> int:
    """The writer process: jobs from stdin, in order, into run `run_id`; each flush answered on
    stdout with the failures since the last. Traces are linked to the run through MLflow's
    tracing context (this process has no active run: ending it would end the run)."""
    import mlflow
    from mlflow.tracing.constant import TraceMetadataKey

    for sig in (signal.SIGINT, signal.SIGTERM):
        # A Ctrl-C or a scheduler's SIGTERM reaches the whole process group: the loop stops on
        # it and flushes; the writer ends when the loop closes its stdin (or dies), never before.
        signal.signal(sig, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the answers
    mlflow.set_tracking_uri(tracking_uri)
    mlflow.set_experiment(experiment_id=experiment_id)
    client = mlflow.MlflowClient()
    failed: list[str] = []
    with mlflow.tracing.context(metadata={TraceMetadataKey.SOURCE_RUN: run_id}):
        while (job := _read(sys.stdin.buffer)) is not None:
            if job[0] == "flush":
                answers.write(json.dumps(failed) + "\n")
                answers.flush()
                failed = []
                continue
            try:
                _write(client, run_id, job)
            except Exception as e:  # noqa: BLE001 - reported at the next flush, the next jobs still run
                log.exception("MLflow writer: %s of run %s failed", job[0], run_id)
                failed.append(f"{job[0]}: {type(e).__name__}: {e}")
    return 1 if failed else 0


def _write(client, run_id: str, job: tuple) -> None:
    from mlflow.entities import Metric

    if job[0] == "metrics":
        _, values, step, timestamp = job
        metrics = [Metric(k, v, timestamp, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per call
            client.log_batch(run_id, metrics=metrics[i:i + 1000])
    elif job[0] == "traces":
        job[1].write(client, run_id)
    else:
        raise ValueError(f"unknown job {job[0]!r}")


def _read(stream) -> tuple | None:
    """The next job, or None at the end of the stream (the loop closed it, or died)."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (size,) = HEADER.unpack(header)
    payload = stream.read(size)
    return pickle.loads(payload) if len(payload) == size else None


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.exit(serve(*sys.argv[1:4]))
