"""Checkpoint files, atomic saves and state round trips. (A resumed run's MLflow run:
test_tracking.py; whole runs killed and resumed: test_resume.py.)"""

import asyncio
import random

import pytest
import torch

from rlexp import checkpoint
from rlexp.data.manager import DataManager
from rlexp.data.sources import ArithmeticSource
from rlexp.errors import CheckpointError, ConfigError
from rlexp.sample import Sample, Status
from rlexp.schedulers.async_scheduler import AsyncScheduler, GroupRollout
from rlexp.schedulers.sync import SyncScheduler
from rlexp.step import rl_step
from rlexp.weights.files import WEIGHTS_FILE, save_safetensors
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
    (ga,), (gb,) = a.sample_groups(1), b.sample_groups(1)
    assert ga[0].group_id == gb[0].group_id == 128
    assert [s.uid for s in ga] == [s.uid for s in gb] == [128 * 4 + i for i in range(4)]  # numbering goes on


def test_run_state_round_trip_through_a_checkpoint(tmp_path):
    """What `RunState.capture` saves, `read` and `restore` put back: the step, the policy
    version, both splits' positions and numbering, the scheduler's state, the RNGs."""
    data, eval_data, scheduler = _data(), _data(), SyncScheduler()
    data.sample_groups(3)
    state = checkpoint.RunState.capture(5, 4, data, eval_data, scheduler).serialize()
    draws = (random.random(), torch.rand(2).tolist())
    path = checkpoint.save(tmp_path, 5, TensorTrainer(), state, "run123", keep_last=0)

    resumed = checkpoint.RunState.read(path)
    assert (resumed.step, resumed.version, resumed.run_id, resumed.path) == (5, 4, "run123", path)
    data2, eval2, scheduler2 = _data(), _data(), SyncScheduler()
    resumed.restore_data(data2, eval2)
    resumed.restore(scheduler2)
    assert (random.random(), torch.rand(2).tolist()) == draws
    assert scheduler2.state_dict() == scheduler.state_dict()
    (g,) = data2.sample_groups(1)
    assert [s.uid for s in g] == [12, 13, 14, 15] and g[0].group_id == 3
    other = DataManager(ArithmeticSource(max_operand=9, ops="+", eval_size=10, seed=0),
                        prompts_per_step=4, samples_per_prompt=4, seed=0)
    with pytest.raises(ConfigError, match=f"resume from {path}: .* the dataset changed"):
        resumed.restore_data(other, eval2)


def test_async_checkpoint_counts_groups_cancelled_as_expired_but_not_yet_booked():
    """A group cancelled as EXPIRED is booked when its task ends; a checkpoint taken before
    then counts it, so a resumed run does not lose it from `samples/expired`."""
    sched = AsyncScheduler(staleness_threshold=1)
    group = [Sample(group_id=5, prompt=[1], answer="2", uid=20 + i) for i in range(4)]
    sched._running.append(GroupRollout(5, 0, group, meter=[7], cancelled=Status.EXPIRED))
    sched.ledger.counts["samples/expired"] = 8  # booked already: two earlier groups
    state = sched.state_dict()
    assert state["counts"] == {"samples/expired": 12, "rollout/untrained_tokens": 7}
    assert state["in_flight"] == []  # not relaunched on resume
    assert sched.ledger.counts["samples/expired"] == 8  # the live run books it once, later
    resumed = AsyncScheduler(staleness_threshold=1)
    resumed.load_state_dict(state)
    assert resumed.pop_counts() == {"samples/expired": 12.0, "rollout/untrained_tokens": 7.0}


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
        while not first.state_dict()["in_flight"]:  # until newly launched groups are in flight
            await asyncio.sleep(0)
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
