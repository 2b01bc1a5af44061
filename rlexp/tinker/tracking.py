"""Every training model of the Tinker server is an MLflow run, beside the Hydra runs of the
same store: params = the base model, LoRA and the trainer's config; metrics per call (loss,
tokens, seconds, gradient norm, learning rate), at the model's optimizer step; checkpoints as
artifacts. Runs are addressed by id (MlflowClient), never through MLflow's active run, since
several models train at once. A server that stops ends its models' runs (FINISHED, or KILLED
when a signal stopped it); a restarted one continues a model's run (its id kept in the model's
meta.json) when the model is loaded again."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient

from rlexp.tracking.mlflow_tracker import experiment_id, flatten

log = logging.getLogger(__name__)


class ModelRun:
    def __init__(self, tracking_uri: str, experiment_name: str, run_name: str, params: dict[str, Any],
                 tags: dict[str, str], artifact_location: str | None = None, log_checkpoints: bool = True,
                 run_id: str | None = None):
        """`run_id`: the model's run of an earlier server process, continued (RUNNING again)
        if the store still has it; otherwise a new run."""
        self.client = MlflowClient(tracking_uri)
        self.log_checkpoints = log_checkpoints
        if run_id is not None and self._continues(run_id):
            self.run_id = run_id
            log.info("tinker: model %s continues MLflow run %s", run_name, run_id)
            return
        exp = experiment_id(self.client, experiment_name, artifact_location)
        self.run_id = self.client.create_run(exp, run_name=run_name, tags=tags).info.run_id
        items = [(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in items[i:i + 100]])
        log.info("tinker: model %s is MLflow run %s", run_name, self.run_id)

    def _continues(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException:  # deleted from the store meanwhile
            return False
        return True

    def metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def checkpoint(self, directory: Path, name: str) -> None:
        if self.log_checkpoints:
            self.client.log_artifacts(self.run_id, str(directory), f"checkpoints/{name}")

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)


def _param(key: str, value: str):
    from mlflow.entities import Param

    return Param(key, value)
