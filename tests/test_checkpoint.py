"""Checkpoint files, atomic saves, state round trips, and truncating a resumed run's metrics
in a real SQLite MLflow store. (Whole runs killed and resumed: test_resume.py.)"""

import asyncio
import random

import mlflow
import pytest
import torch
from mlflow.tracking import MlflowClient

from rlexp import checkpoint
from rlexp.errors import CheckpointError
from rlexp.loop import rl_step
from rlexp.rollout.weights import WEIGHTS_FILE, save_safetensors
from rlexp.schedulers.async_scheduler import AsyncScheduler
from rlexp.tracking.mlflow_tracker import truncate_metrics
from tests.fakes import TimedEngine, VersionOnlyTransport
from tests.test_schedulers import CountingAgent, SleepyTrainer, _data


class TensorTrainer:
    """The checkpoint side of the Trainer Protocol, over one tensor and a state dict."""

    def __init__(self, value: float = 0.0):
        self.w, self.state = torch.full((3,), value), {"lr": value}

    def save(self, directory):
        save_safetensors([("w", self.w)], directory)
        torch.save(self.state, directory / "trainer.pt")

    def load(self, directory):
        from safetensors.torch import load_file

        self.w = load_file(str(directory / WEIGHTS_FILE))["w"]
        self.state = torch.load(directory / "trainer.pt")


def _save(run_dir, step, keep_last=2, state=None):
    state = state or checkpoint.serialize({"step": step})
    return checkpoint.save(run_dir, step, TensorTrainer(float(step)), state, "run123", keep_last)


def _load(path) -> tuple[dict, dict, TensorTrainer]:
    trainer = TensorTrainer()
    trainer.load(path)
    return (*checkpoint.load(path), trainer)


def test_save_load_keep_last_and_latest(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    assert [s for s, _ in checkpoint.checkpoints(tmp_path)] == [2, 3]  # keep_last=2
    meta, state, trainer = _load(checkpoint.latest_checkpoint(tmp_path))
    assert meta["step"] == 3 and meta["mlflow_run_id"] == "run123"
    assert trainer.w.tolist() == [3.0] * 3
    assert trainer.state == {"lr": 3.0} and state == {"step": 3}


def test_a_crash_while_saving_leaves_the_previous_checkpoint_usable(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    real = torch.save

    def crash_after_weights(obj, f, *a, **k):
        real(obj, f, *a, **k)
        raise KeyboardInterrupt("killed mid-save")

    state = checkpoint.serialize({"step": 2})
    monkeypatch.setattr(torch, "save", crash_after_weights)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, state=state)
    monkeypatch.undo()
    assert list((tmp_path / "checkpoints").glob(".tmp-*"))  # the half-written one is there...
    latest = checkpoint.latest_checkpoint(tmp_path)  # ...and ignored
    assert latest.name == "step_1" and _load(latest)[2].w[0] == 1.0
    _save(tmp_path, 2)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the next save cleans up
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_2"


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        checkpoint.latest_checkpoint(tmp_path)
    (tmp_path / "checkpoints" / "step_4").mkdir(parents=True)  # no meta.json: incomplete
    with pytest.raises(CheckpointError):
        checkpoint.latest_checkpoint(tmp_path)


def test_rng_states_round_trip():
    state = checkpoint.rng_state()
    a = (random.random(), torch.rand(2).tolist())
    checkpoint.set_rng_state(state)
    assert (random.random(), torch.rand(2).tolist()) == a


def test_data_manager_continues_where_it_stopped():
    a, b = _data(), _data()
    for _ in range(30):
        a.sample_groups(4)
    b.load_state_dict(a.state_dict())
    prompts = [[s.prompt for s in g] for g in a.sample_groups(8)]
    assert prompts == [[s.prompt for s in g] for g in b.sample_groups(8)]
    assert a.sample_groups(1)[0][0].group_id == b.sample_groups(1)[0][0].group_id == 128


def test_data_manager_refuses_a_changed_dataset():
    a = _data()
    state = a.state_dict() | {"n_problems": 5}
    with pytest.raises(ValueError, match="the dataset changed"):
        a.load_state_dict(state)


def test_async_scheduler_state_restores_waiting_and_in_flight_groups():
    """Snapshot mid-run (groups accepted and in flight), restore into a fresh scheduler,
    continue: no group lost or trained twice, the bound holds."""
    async def go():
        engine, trainer, data = TimedEngine(token_s=0.001), SleepyTrainer(0.2), _data()
        agent = CountingAgent(engine)

        first = AsyncScheduler(staleness_threshold=2)
        for version in range(2):
            await rl_step(first, data, agent, engine, trainer, VersionOnlyTransport(), version)
        await asyncio.sleep(0.01)  # newly launched groups are in flight, earlier ones wait
        state = checkpoint.serialize(first.state_dict())
        data_state = data.state_dict()
        snapshot = first.state_dict()
        await first.aclose()

        second = AsyncScheduler(staleness_threshold=2)
        second.load_state_dict(torch.load(__import__("io").BytesIO(state), weights_only=False))
        data.load_state_dict(data_state)
        for version in range(2, 8):
            await rl_step(second, data, agent, engine, trainer, VersionOnlyTransport(), version)
        await second.aclose()
        return snapshot, trainer

    snapshot, trainer = asyncio.run(go())
    assert snapshot["accepted"] and snapshot["in_flight"]  # the snapshot caught both kinds
    gids = [s.group_id for b in trainer.batches for s in b[::4]]
    assert len(gids) == len(set(gids)) == 32  # 8 batches of 4 groups, none trained twice
    waiting = {r.fresh[0].group_id for r in snapshot["accepted"] + snapshot["in_flight"]}
    assert waiting <= set(gids[8:])  # what was waiting or in flight got trained after the restore
    for v, batch in enumerate(trainer.batches):
        assert max(s.staleness(v) for s in batch) <= 2


def test_truncate_metrics_leaves_each_step_once(tmp_path):
    uri = f"sqlite:///{tmp_path}/m.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("t")
    with mlflow.start_run() as run:
        for step in range(1, 6):
            mlflow.log_metrics({"loss": float(step), "eval": 10.0 * step}, step=step)
    mlflow.set_tracking_uri(uri)
    with mlflow.start_run(run_id=run.info.run_id):
        assert truncate_metrics(run.info.run_id, 3) == 4  # steps 4, 5 of both keys
        client = MlflowClient(uri)
        assert client.get_run(run.info.run_id).data.metrics["loss"] == 3.0  # latest value rolled back
        mlflow.log_metrics({"loss": -4.0}, step=4)
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    assert sorted(history) == [(1, 1.0), (2, 2.0), (3, 3.0), (4, -4.0)]
    assert client.get_run(run.info.run_id).data.metrics == {"loss": -4.0, "eval": 30.0}
