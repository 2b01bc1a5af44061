"""What the distillation run tests share (test_distill_runs.py, test_distill_teachers.py): a
short run of `python -m rlexp.run experiment=smoke` into its own MLflow store, and what a
refused one looks like."""

import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]


def student(model_path: str) -> list[str]:
    """The overrides of a tiny student at `model_path` (model=local's defaults are a
    pretrained model's: its lengths set back to the tiny model's)."""
    return ["model=local", f"model.path={model_path}", "rollout.max_model_len=256",
            "rollout.max_response_tokens=8"]


def distill_run(store, *overrides):
    """`python -m rlexp.run experiment=smoke <overrides>` into an MLflow store in `store`."""
    uri = f"sqlite:///{store}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", "experiment=smoke", f"logger.tracking_uri={uri}",
           f"logger.artifact_location={store}/artifacts", "logger.experiment_name=test",
           f"hydra.run.dir={store}/out", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=dict(os.environ, HF_HUB_OFFLINE="1")), uri


def mlflow_run(uri):
    """The store's one run of experiment "test", and a client of it."""
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    return client, run


def refused(res):
    """Exit code 2 with one line on stderr, no engine started."""
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [x for x in res.stderr.splitlines() if x.startswith("rlexp: config error:")]
    assert len(lines) == 1, res.stderr[-3000:]
    assert "vLLM engine up" not in res.stderr + res.stdout
    return lines[0]
