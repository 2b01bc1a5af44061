"""MLflow tracking: params (flattened resolved config), per-step metrics, trace artifacts."""

from __future__ import annotations

import contextlib
import json
import logging
import random
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Param, Run, ViewType
from omegaconf import DictConfig, OmegaConf

from rlexp.constraints import AtLeast1, Fraction
from rlexp.sample import jsonable_messages

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
    tracking_uri: str
    experiment_name: str
    artifact_location: str | None = None
    run_name: str | None = None
    log_traces: bool = True
    traces_every_n_steps: AtLeast1 = 1
    trace_sample_rate: Fraction = 0.01
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
        """Continue run `run_id` from checkpoint `step`: in a copy of it as it was at that step
        (`continue_run`), so that the steps the interrupted attempt logged after it, which run
        again, appear once."""
        mlflow.set_tracking_uri(self.tracking_uri)
        new_id, resumes = continue_run(MlflowClient(), run_id, step)
        self.run_id = mlflow.start_run(run_id=new_id).info.run_id
        mlflow.set_tags(tags | {RESUMES: str(resumes), "rlexp.resumed_from_step": str(step)})
        log.info("mlflow: resumed run %s at step %d as run %s", run_id, step, new_id)

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
    MLflow's active run belongs to the loop's thread. An MoE run's routing goes beside it,
    compressed binary (`<step>.routing.npz`, one array per line's key), not into the JSON; a
    vision-language run's images go beside it as PNG files (`<step>.images/<line>_<k>.png`),
    each line listing its own (`images`, in the order of the prompt's image parts) and where
    their tokens sit (`image_spans`: [start, end) token positions of each run of image slots)."""
    client = MlflowClient()
    lines, routed = [], {}
    npz = Path(artifact_file).with_suffix(".routing.npz")
    pictures = Path(artifact_file).with_suffix(".images")
    with tempfile.TemporaryDirectory() as tmp:
        for i, s in enumerate(samples):
            line = s.to_trace(decode)
            if (routing := s.trace.routed_experts) is not None:
                routed[str(i)] = routing
                line["routed_experts"] = {"file": npz.name, "key": str(i), "shape": list(routing.shape)}
            if images := (s.mm_infer_info or {}).get("images"):
                line["images"] = [_save_png(image, Path(tmp) / pictures.name / f"{i}_{k}.png")
                                  for k, image in enumerate(images)]
                line["image_spans"] = s.mm_infer_info.get("spans", [])
            lines.append(json.dumps(line))
        client.log_text(run_id, "\n".join(lines) + "\n", artifact_file)
        if routed:
            np.savez_compressed(Path(tmp) / npz.name, **routed)
            client.log_artifact(run_id, str(Path(tmp) / npz.name), str(npz.parent))
        if (Path(tmp) / pictures.name).is_dir():
            client.log_artifacts(run_id, str(Path(tmp) / pictures.name), str(pictures))


def _save_png(image, path: Path) -> str:
    """`image` (PIL) written to `path`; its name relative to the trace file's folder."""
    path.parent.mkdir(exist_ok=True)
    image.save(path, format="PNG")
    return f"{path.parent.name}/{path.name}"


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
        root.set_inputs({"messages": jsonable_messages(s.prompt), "answer": s.answer})
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
                if "sampling" in turn:  # what the request constrained or changed (a server's reply)
                    span.set_attributes({"rlexp.sampling": json.dumps(turn["sampling"])})
        root.set_outputs({"response": s.response_text, "reward": s.reward,
                          "reward_components": s.reward_components}
                         | ({"judge": s.metadata["judge"]} if "judge" in s.metadata else {}))  # a model judge


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
