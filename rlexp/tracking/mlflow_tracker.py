"""MLflow tracking: params (flattened resolved config), per-step metrics, trace artifacts."""

from __future__ import annotations

import contextlib
import json
import logging
import random
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import mlflow
from mlflow.tracking import MlflowClient
from omegaconf import DictConfig, OmegaConf

from rlexp.constraints import AtLeast1, Fraction

log = logging.getLogger(__name__)
EXPERIMENT_KIND = "mlflow.experimentKind"  # MLflow UI: "custom_model_development" = Model training


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flatten(v, f"{prefix}{k}." if prefix or k else ""))
        return out
    return {prefix.rstrip("."): d}


def experiment_id(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    """The experiment `name`, created if missing. Unless someone chose otherwise, it is marked a
    model-training experiment: MLflow's UI then opens on its runs and metric charts, rather than
    inferring a GenAI experiment from the traces rlexp logs."""
    exp = client.get_experiment_by_name(name)
    exp_id = exp.experiment_id if exp else client.create_experiment(name, artifact_location=artifact_location)
    if exp is None or EXPERIMENT_KIND not in exp.tags:
        client.set_experiment_tag(exp_id, EXPERIMENT_KIND, "custom_model_development")
    return exp_id


@dataclass
class MlflowTracker:
    tracking_uri: str
    experiment_name: str
    artifact_location: str | None = None
    run_name: str | None = None
    log_traces: bool = True
    traces_every_n_steps: AtLeast1 = 1
    trace_sample_rate: Fraction = 0.0
    run_id: str | None = field(default=None, init=False)
    tags: dict[str, str] = field(default_factory=dict, init=False)  # e.g. the sweep's parent run, job number
    # Trace JSONL files are serialised and written by one background thread, off the loop.
    _writer: ThreadPoolExecutor | None = field(default=None, init=False, repr=False)
    _pending: list[Future] = field(default_factory=list, init=False, repr=False)

    def start(self, cfg: DictConfig, extra_params: dict[str, Any] | None = None) -> str:
        mlflow.set_tracking_uri(self.tracking_uri)
        experiment_id(MlflowClient(), self.experiment_name, self.artifact_location)
        mlflow.set_experiment(self.experiment_name)
        run = mlflow.start_run(run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        params = flatten(OmegaConf.to_container(cfg, resolve=True)) | (extra_params or {})
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            mlflow.log_params(dict(items[i:i + 100]))
        mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        log.info("mlflow: run %s in experiment %r at %s", self.run_id, self.experiment_name,
                 self.tracking_uri)
        return self.run_id

    def resume(self, run_id: str, step: int, tags: dict[str, str]) -> None:
        """Continue run `run_id` from checkpoint `step`: what the interrupted attempt logged
        after that step is removed (those steps run again), so every step appears once."""
        mlflow.set_tracking_uri(self.tracking_uri)
        run = mlflow.start_run(run_id=run_id)
        self.run_id = run.info.run_id
        removed = truncate_metrics(run_id, step)
        traces = delete_traces_after(run.info.experiment_id, run_id, step)
        resumes = int(run.data.tags.get("rlexp.resumes", "0")) + 1
        mlflow.set_tags(tags | {"rlexp.resumes": str(resumes), "rlexp.resumed_from_step": str(step)})
        log.info("mlflow: resumed run %s at step %d (removed %d metric values and %d traces logged "
                 "after it)", run_id, step, removed, traces)

    def flush(self) -> None:
        """Make sure everything logged so far is in the store (before a checkpoint says so):
        metrics, trace files and sampled traces, all logged asynchronously."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()  # a failed write raises here
        mlflow.flush_async_logging()
        mlflow.flush_trace_async_logging()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step, synchronous=False)

    def log_samples(self, samples, step: int, decode, name: str = "traces") -> None:
        if not self.log_traces or step % self.traces_every_n_steps:
            return
        assert self.run_id is not None, "log_samples before start()"
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="rlexp-traces")
        self._pending = [f for f in self._pending if not f.done() or f.exception()]
        self._pending.append(self._writer.submit(write_trace_file, self.run_id, samples, decode,
                                                 f"{name}/step_{step:05d}.jsonl"))
        if name == "traces" and self.trace_sample_rate > 0:
            rng = random.Random(step)  # the same samples are picked on a rerun
            for s in samples:
                if rng.random() < self.trace_sample_rate:
                    log_mlflow_trace(s, step)

    def end(self, status: str = "FINISHED", error: str | None = None) -> None:
        if self.run_id is not None:
            if error:
                mlflow.set_tag("rlexp.error", error[:5000])
            self.flush()
            mlflow.end_run(status=status)
            self.run_id = None
        if self._writer is not None:
            self._writer.shutdown()
            self._writer = None


def write_trace_file(run_id: str, samples, decode, artifact_file: str) -> None:
    """One step's trajectories as a JSONL artifact of the run (token ids, masks, logprobs,
    versions, decoded text). Runs on the writer thread: the run is named explicitly, since
    MLflow's active run belongs to the loop's thread."""
    lines = "\n".join(json.dumps(s.to_trace(decode)) for s in samples)
    MlflowClient().log_text(run_id, lines + "\n", artifact_file)


@contextlib.contextmanager
def _own_random():
    """OpenTelemetry draws trace and span ids from the global `random`, which every run seeds
    the same way: ids would repeat across runs (one run's traces overwriting another's in
    the store), and tracing would shift the run's own random stream. Give it fresh entropy
    and put the run's state back."""
    state = random.getstate()
    random.seed()
    try:
        yield
    finally:
        random.setstate(state)


def log_mlflow_trace(s, step: int) -> None:
    """One trajectory as an MLflow trace linked to the active run (Traces tab of the run):
    the prompt in, the response and reward out, one child span per turn."""
    with _own_random(), mlflow.start_span(name=f"trajectory step {step}", span_type="AGENT") as root:
        root.set_inputs({"messages": s.prompt, "answer": s.answer})
        mlflow.update_current_trace(tags={"rlexp.step": str(step)})
        root.set_attributes({"rlexp.step": step, "rlexp.uid": s.uid, "rlexp.group_id": s.group_id,
                             "rlexp.status": s.status.value, "rlexp.reward": s.reward,
                             "rlexp.finish_reason": s.finish_reason,
                             "rlexp.policy_version": s.oldest_version})
        for i, turn in enumerate(s.turns):
            kind = "LLM" if turn.get("mask") else "TOOL" if turn.get("role") == "tool" else "UNKNOWN"
            with mlflow.start_span(name=f"turn {i}: {turn.get('role', '')}", span_type=kind) as span:
                span.set_outputs({"text": turn.get("text", "")})
                span.set_attributes({"rlexp.span": list(turn.get("span", [])),
                                     "rlexp.trained": turn.get("mask", 0)})
        root.set_outputs({"response": s.response_text, "reward": s.reward,
                          "reward_components": s.reward_components})


def truncate_metrics(run_id: str, after_step: int) -> int:
    """Delete the run's metric values logged at steps > `after_step`. MLflow has no API for
    this; on its SQL stores (the SQLite default) it is done with MLflow's own tables, keeping
    each metric's "latest value" consistent. Elsewhere the values stay and a warning says so."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = MlflowClient()._tracking_client.store
    if not isinstance(store, SqlAlchemyStore):
        log.warning("resume: %s is not a SQL store; metrics logged after step %d by the interrupted "
                    "attempt stay, and those steps will appear twice", type(store).__name__, after_step)
        return 0
    try:
        writable = store.ManagedSessionMaker(read_only=False)
    except TypeError:  # MLflow releases before read-only sessions
        writable = store.ManagedSessionMaker()
    with writable as session:
        later = session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id, SqlMetric.step > after_step)
        removed = later.delete(synchronize_session=False)
        stale = session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == run_id,
                                                      SqlLatestMetric.step > after_step)
        keys = [m.key for m in stale]
        stale.delete(synchronize_session=False)
        for key in keys:  # the latest remaining value becomes the metric's latest again
            last = (session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id, SqlMetric.key == key)
                    .order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(), SqlMetric.value.desc())
                    .first())
            if last is not None:
                session.add(SqlLatestMetric(run_uuid=run_id, key=key, value=last.value, step=last.step,
                                            timestamp=last.timestamp, is_nan=last.is_nan))
    return removed


def delete_traces_after(experiment_id: str, run_id: str, after_step: int) -> int:
    """Delete the run's sampled-trajectory traces of steps > `after_step`."""
    client = MlflowClient()
    doomed, token = [], None
    while True:
        page = client.search_traces(locations=[experiment_id], run_id=run_id, include_spans=False,
                                    max_results=500, page_token=token)
        doomed += [t.info.trace_id for t in page if int(t.info.tags.get("rlexp.step", -1)) > after_step]
        token = page.token
        if not token:
            break
    if doomed:
        client.delete_traces(experiment_id, trace_ids=doomed)
    return len(doomed)

