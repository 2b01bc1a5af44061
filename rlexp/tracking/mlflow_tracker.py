"""MLflow tracking: params (flattened resolved config), per-step metrics, trace artifacts."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Param, Run, ViewType
from omegaconf import DictConfig, OmegaConf

from rlexp.constraints import AtLeast1, Fraction
from rlexp.tracking.traces import TraceJob
from rlexp.tracking.writer import RunWriter

log = logging.getLogger(__name__)
EXPERIMENT_KIND = "mlflow.experimentKind"  # MLflow UI: "custom_model_development" = Model training
RESUMES = "rlexp.resumes"
REPLACES = "rlexp.replaces"  # on a resumed run: the run it continues (and deleted)


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
    """A run in the MLflow store at `tracking_uri`: its params (the flattened resolved config)
    and config.yaml from the loop's process, then its metrics and trace files (a share of
    those as MLflow traces), which a writer process of its own stores (RunWriter)."""
    tracking_uri: str
    experiment_name: str
    artifact_location: str | None = None
    run_name: str | None = None
    log_traces: bool = True
    traces_every_n_steps: AtLeast1 = 1
    trace_sample_rate: Fraction = 0.001
    run_id: str | None = field(default=None, init=False)
    tags: dict[str, str] = field(default_factory=dict, init=False)  # e.g. the sweep's parent run, job number
    _writer: RunWriter | None = field(default=None, init=False, repr=False)

    def start(self, cfg: DictConfig, extra_params: dict[str, Any] | None = None) -> str:
        mlflow.set_tracking_uri(self.tracking_uri)
        experiment_id(MlflowClient(), self.experiment_name, self.artifact_location)
        mlflow.set_experiment(self.experiment_name)
        run = mlflow.start_run(run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        self._writer = RunWriter(self.tracking_uri, run.info.experiment_id, self.run_id)
        params = flatten(OmegaConf.to_container(cfg, resolve=True)) | (extra_params or {})
        items = [(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            mlflow.log_params(dict(items[i:i + 100]))
        mlflow.log_text(OmegaConf.to_yaml(cfg, resolve=True), "config.yaml")
        log.info("mlflow: run %s in experiment %r at %s", self.run_id, self.experiment_name,
                 self.tracking_uri)
        return self.run_id

    def resume(self, run_id: str, step: int, tags: dict[str, str]) -> None:
        """Continue run `run_id` from checkpoint `step`: in a copy of it as it was at that step
        (`continue_run`), so that the steps the interrupted attempt logged after it, which run
        again, appear once."""
        mlflow.set_tracking_uri(self.tracking_uri)
        new_id, resumes = continue_run(MlflowClient(), run_id, step)
        run = mlflow.start_run(run_id=new_id)
        self.run_id = run.info.run_id
        self._writer = RunWriter(self.tracking_uri, run.info.experiment_id, self.run_id)
        mlflow.set_tags(tags | {RESUMES: str(resumes), "rlexp.resumed_from_step": str(step)})
        log.info("mlflow: resumed run %s at step %d as run %s", run_id, step, new_id)

    def flush(self) -> None:
        """Make sure everything logged so far is in the store (before a checkpoint says so);
        a failed write raises here."""
        if self._writer is not None:
            self._writer.flush()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        assert self._writer is not None, "log_metrics before start()"
        self._writer.metrics(metrics, step)

    def log_samples(self, samples, step: int, decode, name: str = "traces") -> None:
        if not self.log_traces or step % self.traces_every_n_steps:
            return
        assert self._writer is not None, "log_samples before start()"
        rate = self.trace_sample_rate if name == "traces" else 0.0
        self._writer.traces(TraceJob.of(samples, decode, f"{name}/step_{step:05d}.jsonl", step, rate))

    def end(self, status: str = "FINISHED", error: str | None = None) -> None:
        """Wait for the writer to store everything, then end the run (even when a write failed:
        that failure raises after)."""
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                writer.close()
        finally:
            if self.run_id is not None:
                if error:
                    mlflow.set_tag("rlexp.error", error[:5000])
                mlflow.end_run(status=status)
                self.run_id = None


def continue_run(client: MlflowClient, source_id: str, step: int) -> tuple[str, int]:
    """A new run holding what run `source_id` had logged up to checkpoint `step` (tags, params,
    metric values of steps <= `step`, artifacts but trace files of later steps, sampled traces
    of steps <= `step`); the source run is deleted (MLflow's soft delete: `mlflow gc` purges
    it). MLflow has no API that removes logged metric values, so the run cannot be reopened
    and trimmed. Copies an earlier attempt to resume from the same checkpoint left (tagged
    `rlexp.replaces`) are deleted. Returns the new run's id and how many times the run has
    been resumed, this time included."""
    src = client.get_run(source_id)
    exp_id = src.info.experiment_id
    earlier = client.search_runs([exp_id], f"tags.`{REPLACES}` = '{source_id}'",
                                 run_view_type=ViewType.ALL)
    resumes = 1 + max(int(r.data.tags.get(RESUMES, "0")) for r in [src, *earlier])
    for r in earlier:
        if r.info.lifecycle_stage == "active":
            client.delete_run(r.info.run_id)
    run = client.create_run(exp_id, start_time=src.info.start_time, run_name=src.info.run_name,
                            tags=src.data.tags | {REPLACES: source_id})
    _copy_params_and_metrics(client, src, run.info.run_id, step)
    _copy_artifacts(client, source_id, run.info.run_id, step)
    _move_traces(client, exp_id, [source_id, *(r.info.run_id for r in earlier)], run.info.run_id, step)
    if src.info.lifecycle_stage == "active":
        client.delete_run(source_id)
    return run.info.run_id, resumes


def _copy_params_and_metrics(client: MlflowClient, src: Run, new_id: str, step: int) -> None:
    params = [Param(k, v) for k, v in src.data.params.items()]
    for i in range(0, len(params), 100):  # MLflow's limits per call
        client.log_batch(new_id, params=params[i:i + 100])
    history = [m for key in src.data.metrics for m in client.get_metric_history(src.info.run_id, key)]
    kept = [m for m in history if m.step <= step]
    for i in range(0, len(kept), 1000):
        client.log_batch(new_id, metrics=kept[i:i + 1000])


def _copy_artifacts(client: MlflowClient, source_id: str, new_id: str, step: int) -> None:
    """Every artifact of `source_id` into `new_id`, but step files (`traces/step_00012.jsonl`)
    of steps after `step`."""
    with tempfile.TemporaryDirectory(prefix="rlexp-resume-") as tmp:
        root = Path(client.download_artifacts(source_id, "", tmp))
        for f in root.rglob("step_*.jsonl"):
            if int(f.stem.removeprefix("step_")) > step:
                f.unlink()
        if any(root.iterdir()):
            client.log_artifacts(new_id, str(root))


def _traces_by_step(client: MlflowClient, exp_id: str, run_id: str) -> dict[str, int]:
    """The run's sampled-trajectory traces (trace id -> step), linked ones included."""
    out: dict[str, int] = {}
    token = None
    while True:
        page = client.search_traces(locations=[exp_id], run_id=run_id, include_spans=False,
                                    max_results=500, page_token=token)
        out |= {t.info.trace_id: int(t.info.tags.get("rlexp.step", -1)) for t in page}
        token = page.token
        if not token:
            return out


def _move_traces(client: MlflowClient, exp_id: str, runs: list[str], new_id: str, step: int) -> None:
    """Sampled-trajectory traces: those of the source run (`runs[0]`) of steps <= `step`
    linked to the new run; those of later steps, of the source or of an earlier copy, deleted."""
    source = _traces_by_step(client, exp_id, runs[0])
    kept = [t for t, s in source.items() if s <= step]
    for i in range(0, len(kept), 100):  # MLflow's limit per call
        client.link_traces_to_run(kept[i:i + 100], new_id)
    later = [t for t, s in source.items() if s > step]
    later += [t for r in runs[1:] for t, s in _traces_by_step(client, exp_id, r).items() if s > step]
    if later:
        client.delete_traces(exp_id, trace_ids=later)
