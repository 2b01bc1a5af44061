"""Short real runs through `python -m rlexp.run`, checking what landed in MLflow."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_METRICS = [
    "eval/accuracy", "eval/pass_at_1", "eval/response_length_mean", "rollout/reward_mean",
    "train/loss", "train/kl", "train/entropy", "train/grad_norm", "timing/produce_s",
    "timing/fit_s", "timing/sync_s", "throughput/rollout_tokens_per_s", "samples/completed",
]
TRACE_FIELDS = {"prompt", "response", "token_ids", "loss_mask", "logprobs", "reward", "status",
                "policy_version"}


def _run_and_open(store, models, *overrides):
    """A run in `store` (a directory holding an empty MLflow store: `new_store`), the tiny
    model cached in `models`: its MLflow client and run, and the finished process."""
    uri = f"sqlite:///{store}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", "experiment=smoke", f"logger.tracking_uri={uri}",
           f"logger.artifact_location={store}/artifacts", "logger.experiment_name=test",
           f"model.cache_dir={models}", "model.warm_start_steps=40",
           f"hydra.run.dir={store}/out", "trainer.ref_kl_every_n_steps=2", *overrides]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("test")
    (run,) = client.search_runs([exp.experiment_id])
    return client, run, res


def _check_mlflow(client, run, total_steps=3, trace_version=1):
    assert run.info.status == "FINISHED"
    for key in REQUIRED_METRICS:
        assert key in run.data.metrics, key
    loss_steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert loss_steps == list(range(1, total_steps + 1))
    kl_steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/kl")]
    assert kl_steps == [2]  # the reference forward runs every ref_kl_every_n_steps=2 fits only
    eval_steps = [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")]
    assert eval_steps == [0, 2, 3]  # step 0 (before any update), every 2 steps, the end
    assert run.data.params["trainer.total_steps"] == str(total_steps)
    assert run.data.params["derived.samples_per_step"] == "16"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "traces", "eval_traces"} <= names
    traces = sorted(a.path for a in client.list_artifacts(run.info.run_id, "traces"))
    assert traces == [f"traces/step_{i:05d}.jsonl" for i in range(1, total_steps + 1)]
    path = client.download_artifacts(run.info.run_id, "traces/step_00002.jsonl")
    lines = [json.loads(x) for x in Path(path).read_text().splitlines()]
    assert len(lines) == 16
    for row in lines:
        assert TRACE_FIELDS <= row.keys()
        assert len(row["token_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])
        if trace_version is not None:
            assert row["policy_version"] == trace_version  # produced after one weight sync
        n_resp = sum(row["loss_mask"])
        assert all(lp == 0.0 for lp, m in zip(row["logprobs"], row["loss_mask"]) if not m)
        assert n_resp > 0 and row["loss_mask"][-n_resp:] == [1] * n_resp


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory, run_models, new_store):
    """The default run (sync scheduler, vLLM), made once for the tests that read it."""
    return _run_and_open(new_store(tmp_path_factory.mktemp("sync")), run_models)


@pytest.mark.slow
@pytest.mark.vllm
def test_short_vllm_run_lands_in_mlflow(sync_run):
    client, run, res = sync_run
    _check_mlflow(client, run)
    assert "vLLM engine up" in res.stderr + res.stdout


@pytest.mark.slow
def test_short_hf_run_lands_in_mlflow(tmp_path, run_models, new_store):
    client, run, _ = _run_and_open(new_store(tmp_path), run_models, "rollout=hf")
    _check_mlflow(client, run)


def _history(client, run, key):
    return [m.value for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)]


def _traces(client, run, step):
    path = client.download_artifacts(run.info.run_id, f"traces/step_{step:05d}.jsonl")
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


PARITY_METRICS = ["train/loss", "train/pg_loss", "train/entropy", "train/kl", "train/grad_norm",
                  "train/ratio_mean", "rollout/reward_mean", "rollout/response_length_mean",
                  "eval/accuracy", "samples/completed", "rollout/staleness_max"]


@pytest.mark.slow
@pytest.mark.vllm
def test_async_with_staleness_zero_reproduces_sync(tmp_path, run_models, new_store, sync_run):
    """Same seed: the async scheduler at threshold 0 trains on the same batches (token for
    token) and logs the same metrics as the sync scheduler, through real vLLM and MLflow."""
    sync = sync_run[:2]
    async_ = _run_and_open(new_store(tmp_path), run_models, "scheduler=async",
                           "scheduler.staleness_threshold=0")[:2]
    _check_mlflow(*async_)
    for step in (1, 2, 3):
        a, b = _traces(*sync, step), _traces(*async_, step)
        assert [(r["token_ids"], r["versions"], r["reward"]) for r in a] == \
               [(r["token_ids"], r["versions"], r["reward"]) for r in b]
    for key in PARITY_METRICS:
        a, b = _history(*sync, key), _history(*async_, key)
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), key


@pytest.mark.slow
@pytest.mark.vllm
def test_async_run_stays_within_the_staleness_bound(tmp_path, run_models, new_store):
    client, run, _ = _run_and_open(new_store(tmp_path), run_models, "scheduler=async",
                                   "scheduler.staleness_threshold=2", "scheduler.update_mode=keep",
                                   "policy_loss=decoupled", "mismatch=icepop")
    _check_mlflow(client, run, trace_version=None)
    params = run.data.params  # the algorithm's choices, for the compare view
    assert (params["algorithm.policy_loss"], params["algorithm.mismatch"], params["algorithm.advantage"]) == \
        ("decoupled", "icepop", "grpo")
    assert params["trainer.mismatch._target_"] == "rlexp.algorithms.mismatch.IcePop"
    assert _history(client, run, "rollout/prefilled_again_tokens") == [0.0] * 3  # keep: none sent again
    stale = _history(client, run, "rollout/staleness_max")
    assert max(stale) <= 2 and max(stale) >= 1  # ran ahead of the trainer, never past the bound
    for key in ("rollout/engine_idle_frac", "train/idle_frac", "rollout/untrained_tokens",
                "samples/expired", "samples/filtered", "samples/resumed", "train/is_weight_mean",
                "train/masked_token_frac", "rollout/mixed_tokens", "rollout/update_pause_s",
                "rollout/prefilled_again_tokens", "offpolicy/ratio_mean/staleness_0"):
        assert key in run.data.metrics, key
    for step in (1, 2, 3):
        trained = _history(client, run, "train/loss")
        assert len(trained) == 3
        for row in _traces(client, run, step):
            versions = [v for v, m in zip(row["versions"], row["loss_mask"]) if m]
            assert step - 1 - min(versions) <= 2  # staleness, recomputed from the trace


@pytest.mark.slow
@pytest.mark.vllm
def test_a_lora_run_sends_only_its_adapter_and_every_sync_lands(tmp_path, run_models, new_store):
    """weight_transfer=lora_adapter: vLLM serves the base model it loaded once with the
    adapter sent at each sync (peft's files); the in-run check verifies each sync (it stops a
    run whose engine serves other numbers: tests/test_lora_engine.py plants one)."""
    client, run, res = _run_and_open(new_store(tmp_path), run_models, "trainer.lora.rank=8",
                                     "weight_transfer=lora_adapter")
    _check_mlflow(client, run)
    assert run.data.params["weight_transfer._target_"] == "rlexp.weights.adapter_file.AdapterFileTransport"
    assert run.data.params["rollout.max_lora_rank"] == "8"
    diffs = _history(client, run, "sync/logprob_diff_max")
    assert len(diffs) == 3 and max(diffs) <= 1e-4  # every sync checked, the adapter's numbers (float32)
    assert _history(client, run, "sync/tokens")[0] > 0
    assert "(LoRA rank 8)" in res.stdout + res.stderr  # the trainer trained adapters only
