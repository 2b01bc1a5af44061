"""Hydra multirun sweeps: job dirs, MLflow parent/child runs, failed jobs, rlexp.compare,
MLflow traces, against a real MLflow store."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient
from omegaconf import open_dict

import rlexp.config  # noqa: F401  (registers the config resolvers)
from rlexp.tracking.sweep import SweepCallback, count_jobs, job_run_name, varying_keys

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.prompts_per_step=4", "data.samples_per_prompt=4", "evaluator.prompts=16",
         "evaluator.every_n_steps=2", "model.warm_start_steps=40"]


def test_swept_keys_and_run_names():
    overrides = ["trainer.total_steps=2", "scheduler.staleness_threshold=0,1,2,4", "agent=a,b",
                 "trainer.optimizer.lr=range(1,3)"]
    keys = varying_keys(overrides, {"seed": "0,1", "scheduler": "async"})
    assert keys == ["scheduler.staleness_threshold", "agent", "trainer.optimizer.lr", "seed"]
    job = ["trainer.total_steps=2", "scheduler.staleness_threshold=2", "agent=b", "seed=1"]
    assert job_run_name(keys, job) == "staleness_threshold=2,agent=b,seed=1"
    # the progress line's "job k/N": Hydra's basic sweeper's count, sweeper params included
    assert count_jobs(overrides, {"seed": "0,1,2"}) == 4 * 2 * 2 * 3



@pytest.mark.parametrize("overrides", [
    ["a=1,2", "b=3,4,5", "a=7,8,9"],  # a key given again: the last wins
    ["x=choice(1,2,3)", "y=range(0,10,3)", "z=sort(3,1,2)", "+w=1,2", "~v", "agent=a,b"],
    ["lr=interval(0,1)"],             # not a discrete sweep: the basic sweeper refuses it
    ["seed=1"],
])
def test_the_job_count_is_hydras_basic_sweepers(overrides):
    """count_jobs parses with Hydra's public override parser; Hydra's own basic sweeper
    (hydra._internal, checked against Hydra 1.3.8) is the reference it must agree with."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        expected = sum(len(batch) for batch in BasicSweeper.split_arguments(parsed, None))
    except Exception:
        expected = 0
    assert count_jobs(overrides, None) == expected
    assert expected != 0 or "interval" in overrides[0]

def _sweep(tmp_path, models, *overrides):
    """A sweep into `tmp_path` (holding an empty MLflow store: `new_store`), the tiny model
    cached in `models`."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", "-m", *SMALL, *overrides, f"logger.tracking_uri={uri}",
           f"logger.artifact_location={tmp_path}/artifacts", "logger.experiment_name=sweeps",
           f"model.cache_dir={models}", f"hydra.sweep.dir={tmp_path}/sweep"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=ROOT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("sweeps")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    parents = [r for r in runs if r.data.tags.get("rlexp.role") == "parent"]
    children = sorted((r for r in runs if r.data.tags.get("rlexp.role") == "job"),
                      key=lambda r: int(r.data.tags["rlexp.job_num"]))
    return res, client, parents, children


@pytest.mark.slow
@pytest.mark.vllm
def test_staleness_sweep_parent_children_compare_and_traces(tmp_path, run_models, new_store):
    """experiment=staleness_sweep's first and last jobs, thresholds 0 and 4 (in 2 steps no
    group is more than 1 step stale: the bounds 1 and 2 would check what 4 does): a job dir
    and a child run each under one parent run, compared by rlexp.compare, with MLflow traces."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=staleness_sweep"], return_hydra_config=True)
    assert dict(cfg.hydra.sweeper.params) == {"scheduler.staleness_threshold": "0,1,2,4"}  # its 4 jobs
    assert cfg.scheduler._target_ == "rlexp.schedulers.async_scheduler.AsyncScheduler"
    res, client, parents, children = _sweep(new_store(tmp_path), run_models, "experiment=staleness_sweep",
                                            "scheduler.staleness_threshold=0,4", "trainer.total_steps=2",
                                            "logger.trace_sample_rate=0.25")
    assert res.returncode == 0, res.stderr[-4000:]
    console = res.stdout + res.stderr
    assert "progress: step 0/2 0% |" in console and "job 2/2 staleness_threshold=4, sweep ETA" in console
    assert "\r" not in console and "\x1b" not in console   # into a file: no progress-bar redraws
    assert "reset prefix cache" not in console             # vLLM's per-update INFO lines (rlexp/console.py)
    sweep = tmp_path / "sweep"
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [
        f"{i}_staleness_threshold={k}" for i, k in enumerate((0, 4))]
    (parent,) = parents
    assert parent.info.status == "FINISHED"
    assert [c.info.run_name for c in children] == [f"staleness_threshold={k}" for k in (0, 4)]
    for c in children:
        assert c.info.status == "FINISHED"
        assert c.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert c.data.tags["rlexp.sweep_id"] == str(sweep)
        assert c.data.params["scheduler.staleness_threshold"] == c.info.run_name.split("=")[1]
        assert max(m.value for m in client.get_metric_history(c.info.run_id, "rollout/staleness_max")) \
            <= int(c.data.params["scheduler.staleness_threshold"])
    # MLflow traces: sampled trajectories, linked to their run
    traces = client.search_traces(locations=[children[0].info.experiment_id], run_id=children[0].info.run_id)
    assert 0 < len(traces) < 2 * 16  # sampled, not all 32 trained trajectories
    trace = client.get_trace(traces[0].info.trace_id)
    root = [s for s in trace.data.spans if s.parent_id is None][0]
    assert "reward" in root.outputs and root.inputs["messages"][0]["role"] == "user"

    out = subprocess.run([sys.executable, "-m", "rlexp.compare", str(sweep)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [x for x in (sweep / "compare.md").read_text().splitlines()[2:] if x.startswith("|")]
    assert len(rows) == 2 and "staleness_threshold=4" in rows[1]
    for png in ("compare_eval_accuracy.png", "compare_rollout_reward_mean.png"):
        assert (sweep / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "compare")}
    assert "compare/compare_eval_accuracy.png" in logged and "compare/compare.md" in logged


@pytest.mark.slow
def test_a_failed_job_is_logged_and_the_sweep_goes_on(tmp_path, run_models, new_store):
    # Job 1 asks for more prompts per step than the train split has: a config error.
    res, _, parents, children = _sweep(new_store(tmp_path), run_models, "rollout=hf", "trainer.total_steps=1",
                                       "data.prompts_per_step=4,100000")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "1 job(s) finished, 1 failed" in res.stdout
    assert [c.info.status for c in children] == ["FINISHED", "FAILED"]
    assert "cannot be filled" in children[1].data.tags["rlexp.error"]
    assert parents[0].info.status == "FAILED"


def test_launching_a_sweep_dir_again_reuses_its_parent(tmp_path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"logger.tracking_uri=sqlite:///{tmp_path}/m.db",
                                           f"hydra.sweep.dir={tmp_path}/sweep", "logger.experiment_name=x"],
                      return_hydra_config=True)
    for _ in range(2):
        SweepCallback().on_multirun_start(cfg)
        SweepCallback().on_multirun_end(cfg)
    info = json.loads((tmp_path / "sweep" / "rlexp_sweep.json").read_text())
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    runs = client.search_runs([client.get_experiment_by_name("x").experiment_id])
    assert [r.info.run_id for r in runs] == [info["parent_run_id"]]


def test_compare_reads_the_store_from_the_sweep_dir_before_the_environment(tmp_path, monkeypatch):
    from rlexp.compare import find_sweep
    from rlexp.tracking.sweep import SWEEP_FILE

    own = f"sqlite:///{tmp_path}/sweep.db"
    (tmp_path / SWEEP_FILE).write_text(json.dumps({"tracking_uri": own, "parent_run_id": "p"}))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/other.db")
    client, parent_id, sweep_dir = find_sweep(str(tmp_path), None)
    assert (client.tracking_uri, parent_id, sweep_dir) == (own, "p", tmp_path)
    client, _, _ = find_sweep(str(tmp_path), f"sqlite:///{tmp_path}/flag.db")
    assert client.tracking_uri == f"sqlite:///{tmp_path}/flag.db"


def test_mlflow_traces_of_equally_seeded_runs_do_not_collide(tmp_path):
    """Trace ids come from the global `random`, which every run seeds the same way: each
    run's traces must survive, and logging them must not shift the run's random stream."""
    import random

    from omegaconf import OmegaConf

    from rlexp.sample import Sample, Status, TokenTrace
    from rlexp.tracking.mlflow_tracker import MlflowTracker

    uri = f"sqlite:///{tmp_path}/m.db"
    for _ in range(2):
        tracker = MlflowTracker(uri, "t", trace_sample_rate=1.0)
        tracker.start(OmegaConf.create({"seed": 0}))
        random.seed(0)
        s = Sample(group_id=0, prompt=[{"role": "user", "content": "1+1="}], answer="2",
                   response_text="2", reward=1.0, status=Status.COMPLETED,
                   trace=TokenTrace(turns=[{"role": "assistant", "text": "2", "span": [0, 1], "mask": 1}]))
        tracker.log_samples([s], 1, decode=lambda ids: "")
        after = random.random()
        tracker.end()
        random.seed(0)
        assert after == random.random()  # tracing left the run's random stream alone
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("t")
    assert len(client.search_traces(locations=[exp.experiment_id])) == 2



def test_the_mlflow_ui_still_reads_the_saved_view_rlexp_writes():
    """save_compare_view writes what MLflow's UI stores for its Share button (an experiment tag
    and a view-state JSON) and links to it: a UI convention, not a Python API. Without a
    browser, check that the installed UI still knows each name it relies on (the browser
    test checks what it draws)."""
    import mlflow

    from rlexp.tracking.sweep import save_compare_view

    bundle = "".join(f.read_text(errors="ignore")
                     for f in (Path(mlflow.__file__).parent / "server/js/build/static/js").glob("*.js"))
    client = MlflowClient(tracking_uri="sqlite:///:memory:")
    exp = client.create_experiment("v")
    route = save_compare_view(client, exp, "p1", ["scheduler.staleness_threshold", "seed"])
    tags = client.get_experiment(exp).tags
    (key,) = [k for k in tags if k.endswith("p1")]
    state = json.loads(tags[key])
    names = [key.removesuffix("p1"), "mlflow.experimentKind", "custom_model_development", *state,
             *state["groupBy"], *(p.split("=")[0] for p in route.split("?")[1].split("&")),
             route.rsplit("=", 1)[1]]
    assert [n for n in names if n not in bundle] == []

def _need_chromium() -> None:
    """Skip without Chromium, but fail under CI (the env var CI set, as CI services do): there
    `make browser` installs it, and a failed install must not pass as a skip."""
    if shutil.which("chromium") is None:
        if os.environ.get("CI", "").lower() not in ("", "0", "false"):
            pytest.fail("CI is set and chromium is missing (scripts/install_chromium.sh failed?)")
        pytest.skip("needs chromium (scripts/install_chromium.sh); required when CI is set")


@pytest.mark.slow
def test_mlflow_ui_in_a_real_browser_charts_every_child_run(tmp_path):
    _need_chromium()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"logger.tracking_uri=sqlite:///{tmp_path}/m.db",
                                           f"hydra.sweep.dir={tmp_path}/sweep", "logger.experiment_name=ui"],
                      return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.sweeper.params = {"scheduler.staleness_threshold": "0,1,2,4"}  # what -m ... would set
    SweepCallback().on_multirun_start(cfg)
    info = json.loads((tmp_path / "sweep" / "rlexp_sweep.json").read_text())
    client = MlflowClient(tracking_uri=info["tracking_uri"])
    kind = client.get_experiment(info["experiment_id"]).tags["mlflow.experimentKind"]
    assert kind == "custom_model_development"  # the UI opens it as Model training
    for k in (0, 1, 2, 4):
        run = client.create_run(info["experiment_id"], run_name=f"staleness_threshold={k}",
                                tags={"mlflow.parentRunId": info["parent_run_id"], "rlexp.role": "job"})
        client.log_param(run.info.run_id, "scheduler.staleness_threshold", str(k))
        for step, acc in ((0, 0.2), (10, 0.3 + 0.05 * k), (20, 0.4 + 0.02 * k)):
            client.log_metric(run.info.run_id, "eval/accuracy", acc, step=step)
        client.set_terminated(run.info.run_id)
    shot = tmp_path / "ui.png"
    cmd = [sys.executable, "scripts/ui_check.py", str(tmp_path / "sweep"), "--screenshot", str(shot)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    assert "4/4 child runs drawn in the eval/accuracy chart" in res.stdout
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    SweepCallback().on_multirun_end(cfg)  # else its parent run is closed at exit, as a stopped sweep's
