"""The run's writer process: the loop's process makes none of the loop's MLflow writes, a
failed write is named at the next flush without losing the writes after it, a writer that
died is named, and a loop that dies leaves what it logged in the store."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient
from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository
from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
from omegaconf import OmegaConf

from rlexp.tracking.mlflow_tracker import MlflowTracker
from rlexp.tracking.writer import WriterGone
from tests.test_tracking import _active, _sample, _state


def _started(uri: str) -> MlflowTracker:
    tracker = MlflowTracker(uri, "t", run_name="r", trace_sample_rate=1.0)
    tracker.start(OmegaConf.create({"seed": 0}))
    return tracker


def test_the_loops_process_writes_no_metric_trace_file_or_trace(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/m.db"
    tracker = _started(uri)

    def refuse(*args, **kwargs):
        raise AssertionError("an MLflow write in the loop's process")

    for write in ("log_batch", "log_metric", "start_trace", "log_spans"):
        monkeypatch.setattr(SqlAlchemyStore, write, refuse)
    monkeypatch.setattr(LocalArtifactRepository, "log_artifact", refuse)
    for step in (1, 2):
        tracker.log_metrics({"loss": -step}, step)
        tracker.log_samples([_sample(step)], step, decode=lambda ids: "")
    tracker.flush()
    monkeypatch.undo()
    tracker.end()
    state = _state(MlflowClient(uri), _active(MlflowClient(uri)))
    assert state["loss"] == [(1, -1.0), (2, -2.0)]
    assert state["files"] == ["traces/step_00001.jsonl", "traces/step_00002.jsonl"]
    assert state["traced"] == [1, 2]


def test_a_failed_write_is_named_at_the_next_flush_and_the_writes_after_it_land(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    tracker = _started(uri)
    tracker.log_metrics({"loss": 1.0}, 1)
    tracker.log_metrics({"bad name?!": 1.0}, 2)  # MLflow refuses the name
    tracker.log_metrics({"loss": 3.0}, 3)
    with pytest.raises(RuntimeError, match=r"metrics: .*bad name\?!"):
        tracker.flush()
    tracker.flush()  # each failure is reported once
    tracker.end()
    run = _active(MlflowClient(uri))
    assert _state(MlflowClient(uri), run)["loss"] == [(1, 1.0), (3, 3.0)]
    assert run.info.status == "FINISHED"


def test_a_ctrl_c_or_sigterm_to_the_process_group_leaves_the_writer_to_the_loop(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    tracker = _started(uri)
    assert tracker._writer is not None
    tracker.log_metrics({"loss": 1.0}, 1)
    tracker.flush()  # the writer is up and has its signal handlers
    for sig in (signal.SIGINT, signal.SIGTERM):
        tracker._writer.process.send_signal(sig)
    tracker.log_metrics({"loss": 2.0}, 2)
    tracker.end()
    assert _state(MlflowClient(uri), _active(MlflowClient(uri)))["loss"] == [(1, 1.0), (2, 2.0)]


def test_a_writer_that_died_is_named_and_the_run_still_ends(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    tracker = _started(uri)
    assert tracker._writer is not None
    tracker._writer.process.kill()
    tracker.log_metrics({"loss": 1.0}, 1)
    with pytest.raises(WriterGone, match=r"writer process of run \w+ exited with code -9"):
        tracker.flush()
    with pytest.raises(WriterGone):
        tracker.end(status="FAILED")
    assert _active(MlflowClient(uri)).info.status == "FAILED"


DIES = """
import os, sys
from omegaconf import OmegaConf
from rlexp.tracking.mlflow_tracker import MlflowTracker
from tests.test_tracking import _sample
tracker = MlflowTracker(sys.argv[1], "t", trace_sample_rate=1.0)
tracker.start(OmegaConf.create({"seed": 0}))
for step in (1, 2, 3):
    tracker.log_metrics({"loss": float(step)}, step)
    tracker.log_samples([_sample(step)], step, decode=lambda ids: "")
tracker._writer._outbox.join()  # every job in the writer's pipe
print(tracker._writer.process.pid, flush=True)
os._exit(1)  # killed: no flush, no end
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_what_a_dead_loop_logged_is_stored_by_its_writer(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    out = subprocess.run([sys.executable, "-c", DIES, uri], capture_output=True, text=True, check=False,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 1, out.stderr
    writer = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 120  # the writer stores what it received, then exits
    while _running(writer) and time.monotonic() < deadline:
        time.sleep(0.1)
    state = _state(MlflowClient(uri), _active(MlflowClient(uri)))
    assert state["loss"] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert state["files"] == [f"traces/step_0000{s}.jsonl" for s in (1, 2, 3)]
    assert state["traced"] == [1, 2, 3]
    line = json.loads(open(MlflowClient(uri).download_artifacts(
        _active(MlflowClient(uri)).info.run_id, "traces/step_00003.jsonl", str(tmp_path))).read())
    assert line["answer"] == "4"
