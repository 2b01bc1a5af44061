"""Sweeps beyond one machine: Hydra's submitit launcher for SLURM (conf/hydra/launcher/slurm.yaml).
There is no SLURM here: the sweep runs for real up to `sbatch`, which a stand-in on PATH
records; the test reads the job array submitit wrote."""

import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]


def test_the_slurm_launcher_config_composes_over_submitit_slurm():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu",
                                           "hydra.launcher.gpus_per_node=8"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.partition, launcher.gpus_per_node, launcher.timeout_min) == ("gpu", 8, 240)
    assert launcher.max_num_timeout == 0  # a key only submitit_slurm has: ours extends it


def test_a_slurm_sweep_submits_one_array_job_per_sweep(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_ins = {"sbatch": f'cp "$1" {tmp_path}/submitted.sh\necho "sbatch: no cluster here" >&2\nexit 1',
                 "srun": "exit 1"}  # submitit looks for srun first
    for name, body in stand_ins.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", "-m", "hydra/launcher=slurm", "hydra.launcher.partition=gpu",
           "scheduler=async", "scheduler.staleness_threshold=0,1,2", f"logger.tracking_uri={uri}",
           f"hydra.sweep.dir={tmp_path}/sweep"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env=dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert res.returncode != 0 and "no cluster here" in res.stderr + res.stdout
    script = (tmp_path / "submitted.sh").read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=1", "#SBATCH --time=240",
                 "#SBATCH --array=0-2%3", "#SBATCH --cpus-per-task=16", f"source {ROOT}/.venv/bin/activate",
                 "submitit.core._submit"):
        assert line in script, f"{line!r} not in the sbatch script:\n{script}"
    assert (tmp_path / "sweep" / "rlexp_sweep.json").is_file()  # the MLflow parent run came first
