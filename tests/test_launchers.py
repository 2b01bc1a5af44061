"""Sweeps on SLURM (hydra/launcher=slurm: Hydra's submitit launcher, conf/hydra/launcher/slurm.yaml)
on a real one-node SLURM started on this machine (tests/slurm.py, scripts/slurm.sh). It has no
accounting database, so `sacct` fails: submitit logs that at each poll and learns that a job
ended from the job's result file alone."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from mlflow.tracking import MlflowClient

from tests.processes import like_a_terminal
from tests.slurm import ROOT, run_slurm, slurm_out

pytestmark = pytest.mark.serial  # see "serial" in pyproject.toml
FAILSAFE_S = 600  # for a sweep here; 3 jobs of 2 steps take about a minute on 2 cores


def test_the_slurm_launcher_config_composes_over_submitit_slurm():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                           "hydra.launcher.gpus_per_node=8"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min) == ("gpu", 8, 240)
    assert launcher.max_num_timeout == 0  # a key only submitit_slurm has: ours extends it


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    yield from run_slurm(tmp_path_factory.mktemp("slurm"))


def _sweep_cmd(store: Path, models: Path, cpus: str, *overrides: str) -> list[str]:
    """A sweep of 2-step runs; each job asks for all the node's CPUs, so they run one at a time."""
    return [sys.executable, "-X", "faulthandler", "-m", "rlexp.run", "-m", "hydra/launcher=slurm",
            "hydra.launcher.gpus_per_node=0",
            f"hydra.launcher.cpus_per_task={cpus}", "hydra.launcher.mem_gb=4",
            "experiment=smoke", "rollout=hf", "trainer.total_steps=2", "checkpoint.every_n_steps=0",
            "model.warm_start_steps=40", f"model.cache_dir={models}", "scheduler=async",
            f"logger.tracking_uri=sqlite:///{store}/mlflow.db", f"logger.artifact_location={store}/art",
            "logger.experiment_name=slurm", f"hydra.sweep.dir={store}/sweep", *overrides]


@pytest.fixture
def launch(slurm, run_models, tmp_path):
    """Starts the test's sweep in the background; at teardown a launcher still running (the test
    failed) is killed, and the module's teardown cancels its jobs."""
    started = []

    def start(*overrides: str) -> subprocess.Popen:
        cpus = slurm_out(slurm, "sinfo", "-h", "-o", "%c").strip()
        with open(tmp_path / "launcher.log", "w") as log:
            started.append(subprocess.Popen(_sweep_cmd(tmp_path, run_models, cpus, *overrides), cwd=ROOT,
                                            env=slurm, stdout=log, stderr=subprocess.STDOUT, text=True,
                                            preexec_fn=like_a_terminal))
        return started[-1]

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _finish(proc: subprocess.Popen, store: Path) -> str:
    """The launcher's log once it exited. One still running past the failsafe is aborted: its
    faulthandler writes every thread's stack into the log, which the failure shows."""
    try:
        proc.wait(timeout=FAILSAFE_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait()
        raise AssertionError("the launcher did not exit; its log, with its stacks when aborted:\n"
                             + (store / "launcher.log").read_text()[-12000:]) from None
    return (store / "launcher.log").read_text()


def _wait_for(what: str, ready, failsafe_s: float = FAILSAFE_S):
    deadline = time.monotonic() + failsafe_s
    while time.monotonic() < deadline:
        if value := ready():
            return value
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what} after {failsafe_s} s")


def _array_id(sweep: Path) -> str | None:
    """The sweep's SLURM job array (submitit's folder `<id>`, its tasks' `<id>_<n>`); for a sweep of
    one job, submitit submits a single job instead (its folder: `<id>`)."""
    folders = [p.name for p in (sweep / ".submitit").glob("*") if p.is_dir() and "_" not in p.name]
    return folders[0] if folders else None


def _job_states(env: dict, array: str) -> dict[str, str]:
    out = slurm_out(env, "squeue", "-h", "-t", "all", "-j", array, "-o", "%i %T")
    return dict(sorted(line.split() for line in out.splitlines()))


def _end_states(env: dict, array: str, jobs: int) -> dict[str, str]:
    """The array's job states once SLURM has ended its `jobs` tasks: a task writes its result file,
    which is what the launcher waits for, a moment before its SLURM job ends."""
    def ended():
        states = _job_states(env, array)
        running = {"PENDING", "RUNNING", "COMPLETING"} & set(states.values())
        return len(states) == jobs and not running and states
    return _wait_for("SLURM to end the jobs", ended)


def _runs(store: Path) -> tuple[MlflowClient, list, list]:
    client = MlflowClient(tracking_uri=f"sqlite:///{store}/mlflow.db")
    exp = client.get_experiment_by_name("slurm")
    runs = client.search_runs([exp.experiment_id]) if exp else []
    parents = [r for r in runs if r.data.tags.get("rlexp.role") == "parent"]
    children = sorted((r for r in runs if r.data.tags.get("rlexp.role") == "job"),
                      key=lambda r: int(r.data.tags["rlexp.job_num"]))
    return client, parents, children


def _while_a_job_runs(env: dict, proc: subprocess.Popen) -> str:
    """sinfo and squeue as soon as squeue shows a job running (the launcher still waiting)."""
    _wait_for("a running job", lambda: proc.poll() is not None or slurm_out(env, "squeue", "-h", "-t", "R"))
    return f"$ sinfo\n{slurm_out(env, 'sinfo')}$ squeue\n{slurm_out(env, 'squeue')}"


@pytest.mark.slow
def test_a_sweep_runs_as_a_slurm_job_array_into_mlflow_and_rlexp_compare(slurm, launch, tmp_path):
    proc = launch("scheduler.staleness_threshold=0,1,2")
    during = _while_a_job_runs(slurm, proc)
    log = _finish(proc, tmp_path)
    print(f"while the jobs ran:\n{during}", flush=True)
    assert proc.returncode == 0, log[-4000:]
    sweep, array = tmp_path / "sweep", _array_id(tmp_path / "sweep")
    assert f"{array}_0 " in during and " R " in during  # a task of the array was running
    assert _end_states(slurm, array, 3) == {f"{array}_{i}": "COMPLETED" for i in range(3)}
    assert f"rlexp: sweep {sweep}: 3 job(s) finished\n" in log
    assert "Bypassing sacct error" in log  # no accounting here: submitit went by the result files

    client, (parent,), children = _runs(tmp_path)
    assert parent.info.status == "FINISHED"
    assert [c.info.run_name for c in children] == [f"staleness_threshold={k}" for k in (0, 1, 2)]
    for c in children:
        assert c.info.status == "FINISHED" and c.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert c.data.tags["rlexp.job_dir"].startswith(str(sweep))

    out = subprocess.run([sys.executable, "-m", "rlexp.compare", str(sweep)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [x for x in (sweep / "compare.md").read_text().splitlines()[2:] if x.startswith("|")]
    assert [r.split("|")[2].strip() for r in rows] == [f"staleness_threshold={k}" for k in (0, 1, 2)]


@pytest.mark.slow
def test_a_job_that_fails_in_rlexp_is_failed_in_mlflow_and_in_the_summary(slurm, launch, tmp_path):
    """rlexp catches the job's error (here a config error), logs a FAILED child run and returns,
    so the SLURM job exits 0 and writes its result file: submitit sees it done by that file
    (as any job here: no sacct), with nothing to time out."""
    proc = launch("scheduler.staleness_threshold=0,-1")
    log = _finish(proc, tmp_path)
    assert proc.returncode == 1, log[-4000:]
    sweep, array = tmp_path / "sweep", _array_id(tmp_path / "sweep")
    assert f"rlexp: sweep {sweep}: 1 job(s) finished, 1 failed: staleness_threshold=-1\n" in log
    assert _end_states(slurm, array, 2) == {f"{array}_0": "COMPLETED", f"{array}_1": "COMPLETED"}
    assert (sweep / ".submitit" / f"{array}_1" / f"{array}_1_0_result.pkl").is_file()

    _, (parent,), children = _runs(tmp_path)
    assert parent.info.status == "FAILED"
    assert [c.info.status for c in children] == ["FINISHED", "FAILED"]
    assert "staleness_threshold must be >= 0, got -1" in children[1].data.tags["rlexp.error"]


@pytest.mark.slow
def test_a_job_killed_without_its_result_is_reported_when_the_launcher_is_stopped(slurm, launch, tmp_path):
    """A job killed mid-run (SIGKILL, as from the OOM killer) writes no result file. Without
    sacct submitit never learns that it ended, and the launcher waits until stopped (with
    sacct, submitit raises instead): either way Hydra skips on_multirun_end, and rlexp closes
    the sweep at exit, its parent run FAILED and the job listed."""
    # Steps enough that the job is still running when killed.
    proc = launch("scheduler.staleness_threshold=1", "run_name=killed", "trainer.total_steps=1000")
    sweep = tmp_path / "sweep"
    array = _wait_for("the job array", lambda: _array_id(sweep))
    _wait_for("the job's MLflow run", lambda: _runs(tmp_path)[2])
    for line in slurm_out(slurm, "scontrol", "listpids", f"{array}.0").splitlines()[1:]:
        os.kill(int(line.split()[0]), signal.SIGKILL)  # the job step's processes: rlexp's
    assert _end_states(slurm, array, 1) == {array: "FAILED"}  # one job: not an array
    assert not list((sweep / ".submitit").glob("*/*_result.pkl"))
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    log = _finish(proc, tmp_path)
    assert proc.returncode != 0
    _, (parent,), (child,) = _runs(tmp_path)
    assert f"rlexp: sweep {sweep} stopped before every job reported: 0 job(s) finished, " \
           "1 failed: killed (RUNNING)\n" in log
    assert parent.info.status == "FAILED"
    assert child.info.status == "RUNNING"  # its process was killed before it could close its run


def _no_sweep_started(tmp_path: Path, env: dict) -> str:
    cmd = [sys.executable, "-m", "rlexp.run", "-m", "hydra/launcher=slurm", "scheduler=async",
           "scheduler.staleness_threshold=0,1", f"logger.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
           f"hydra.sweep.dir={tmp_path}/sweep"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr[-3000:]
    assert not (tmp_path / "sweep").exists() and not (tmp_path / "mlflow.db").exists()  # no job, no run
    return res.stderr


def test_without_a_slurm_client_the_sweep_stops_before_any_job_or_mlflow_run(tmp_path):
    err = _no_sweep_started(tmp_path, dict(os.environ, PATH=str(Path(sys.executable).parent)))
    assert "rlexp: hydra/launcher=slurm: sbatch, srun, scontrol not on PATH" in err


def test_with_the_slurm_controller_down_the_sweep_stops_before_any_job_or_mlflow_run(slurm, tmp_path):
    """The same slurm.conf, with the controller's port moved to one where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free_port = s.getsockname()[1]
    conf = Path(slurm["SLURM_CONF"]).read_text().replace("SlurmctldPort=", f"SlurmctldPort={free_port}\n#")
    (tmp_path / "slurm.conf").write_text(conf)
    err = _no_sweep_started(tmp_path, dict(slurm, SLURM_CONF=str(tmp_path / "slurm.conf")))
    assert "rlexp: hydra/launcher=slurm: its controller does not answer (scontrol ping: " \
           "Slurmctld(primary) at" in err and "is DOWN)" in err
