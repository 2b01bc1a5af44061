"""Hydra multirun <-> MLflow: one parent run per sweep, one child run per job.

The Hydra callback creates (or, for a sweep dir that already has one, reuses) the parent
run before any job starts and writes `rlexp_sweep.json` into the sweep dir; each job reads
it to nest its run under the parent and to name itself by what differs between jobs.
With hydra/launcher=slurm it first checks that SLURM answers."""

from __future__ import annotations

import atexit
import json
import logging
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)
SWEEP_FILE = "rlexp_sweep.json"
SWEEP_TAG = "rlexp.sweep_id"
SHARED_VIEW = "mlflow.sharedViewState."  # + key: a runs-page view state (MLflow UI's Share button)
SWEEP_FUNCTIONS = ("range(", "choice(", "glob(", "interval(", "tag(", "sort(", "shuffle(")
SLURM_LAUNCHER = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
SLURM_PING_S = 10  # scontrol retries a missing slurm.conf for 60 s: bound the check


def varying_keys(overrides: list[str], sweeper_params: dict | None) -> list[str]:
    """Keys swept over more than one value, from the command line and `hydra.sweeper.params`."""
    specs = [o.split("=", 1) for o in overrides if "=" in o]
    specs += [[k, str(v)] for k, v in (sweeper_params or {}).items()]
    out = []
    for key, value in specs:
        key = key.lstrip("+~")
        if ("," in value or value.strip().startswith(SWEEP_FUNCTIONS)) and key not in out:
            out.append(key)
    return out


def count_jobs(overrides: list[str], sweeper_params: dict | None) -> int:
    """How many jobs Hydra's basic sweeper makes of these (0 when it cannot tell): the product
    of each key's number of values, the last override of a key winning. Parsed with Hydra's
    override parser, as its sweeper plugins do."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    specs = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + overrides
    try:
        parsed = OverridesParser.create().parse_overrides(specs)
        if any(o.is_sweep_override() and not o.is_discrete_sweep() for o in parsed):
            return 0  # interval(): the basic sweeper refuses it
        sizes = {o.get_key_element(): len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1
                 for o in parsed}
    except Exception:  # e.g. glob() needs the config loader; the count only feeds the progress line
        return 0
    return math.prod(sizes.values())


def job_run_name(varying: list[str], job_overrides: list[str]) -> str:
    """`staleness_threshold=2`: the job's values of the swept keys (last key component)."""
    values = dict(o.lstrip("+~").split("=", 1) for o in job_overrides if "=" in o)
    parts = [f"{k.rsplit('.', 1)[-1]}={values[k]}" for k in varying if k in values]
    return ",".join(parts) or ",".join(job_overrides) or "default"


def read_sweep(sweep_dir: str | Path) -> dict | None:
    path = Path(sweep_dir) / SWEEP_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def _mlflow_client(tracking_uri: str) -> MlflowClient:
    from mlflow.tracking import MlflowClient  # seconds to import: only when a sweep needs it

    return MlflowClient(tracking_uri=tracking_uri)


def _client(cfg: DictConfig) -> tuple[MlflowClient, str]:
    from rlexp.tracking.mlflow_tracker import experiment_id

    client = _mlflow_client(cfg.logger.tracking_uri)
    return client, experiment_id(client, cfg.logger.experiment_name, cfg.logger.get("artifact_location"))


def save_compare_view(client: MlflowClient, exp_id: str, parent_id: str, group_by: list[str],
                      metric: str = "eval/accuracy") -> str:
    """A saved view of MLflow's runs page (what its Share button stores, as an experiment tag):
    the sweep's child runs grouped by the swept keys other than `seed`, every run its own line
    in chart mode, charts narrowed to `metric`. Returns the UI route (after the server's
    address) that opens it, in the Model training workflow. The tag's name, the state's keys
    and the route are the UI's conventions, with no Python API: checked against MLflow 3.17.2
    (tests/test_sweep.py checks them against the installed UI, and in a real browser)."""
    keys = [{"mode": "param", "groupByData": k} for k in group_by if k != "seed"]
    state = {"searchFilter": f"tags.`mlflow.parentRunId` = '{parent_id}'",
             "orderByKey": "attributes.start_time", "orderByAsc": True, "runsHiddenMode": "SHOW_ALL",
             "chartsSearchFilter": metric, "hideEmptyCharts": True, "useGroupedValuesInCharts": False,
             "groupBy": {"groupByKeys": keys, "aggregateFunction": "average"} if keys else None}
    client.set_experiment_tag(exp_id, f"{SHARED_VIEW}{parent_id}", json.dumps(state))
    return (f"/#/experiments/{exp_id}/runs?viewStateShareKey={parent_id}&compareRunsMode=CHART"
            "&workflowType=machine_learning")


def _first_line(out: str | bytes | None) -> str:
    text = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
    return (text.strip().splitlines() or [""])[0]


def slurm_unreachable() -> str | None:
    """Why SLURM cannot take jobs from here (None: it can): its commands are not on PATH, or
    its controller does not answer `scontrol ping`."""
    missing = [c for c in ("sbatch", "srun", "scontrol") if shutil.which(c) is None]
    if missing:
        return f"{', '.join(missing)} not on PATH (no SLURM client on this machine)"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=SLURM_PING_S)
    except subprocess.TimeoutExpired as e:  # its output so far is bytes, text=True or not
        return f"scontrol ping did not answer in {SLURM_PING_S} s: {_first_line(e.stderr)}"
    if ping.returncode != 0:
        return f"its controller does not answer (scontrol ping: {_first_line(ping.stdout + ping.stderr)})"
    return None


def close_sweep(sweep_dir: Path, stopped: bool = False) -> bool:
    """Close the sweep's parent run, FINISHED or FAILED, and print the sweep's summary; True when
    every job finished. `stopped`: the launcher stopped before every job reported back (Ctrl-C,
    or it raised), so the parent is FAILED and a job listed RUNNING may still run on a cluster."""
    info = read_sweep(sweep_dir)
    if info is None:
        return True
    client = _mlflow_client(info["tracking_uri"])
    children = client.search_runs([info["experiment_id"]],
                                  f"tags.`mlflow.parentRunId` = '{info['parent_run_id']}'")
    failed = [c.info.run_name + ("" if c.info.status == "FAILED" else f" ({c.info.status})")
              for c in children if c.info.status != "FINISHED"]
    client.set_terminated(info["parent_run_id"], status="FAILED" if failed or stopped else "FINISHED")
    print(f"rlexp: sweep {sweep_dir}" + (" stopped before every job reported" if stopped else "")
          + f": {len(children) - len(failed)} job(s) finished"
          + (f", {len(failed)} failed: {', '.join(failed)}" if failed else "")
          + f"\n  compare: python -m rlexp.compare {sweep_dir}"
          + f"\n  in the MLflow UI (make ui): http://127.0.0.1:5000{info.get('compare_view', '')}")
    return not (failed or stopped)


class SweepCallback(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        if config.hydra.launcher.get("_target_") == SLURM_LAUNCHER and (why := slurm_unreachable()):
            print(f"rlexp: hydra/launcher=slurm: {why}; no job submitted", file=sys.stderr)
            raise SystemExit(2)  # before the parent run: nothing to clean up
        sweep_dir = Path(config.hydra.sweep.dir).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        client, exp_id = _client(config)
        sweep_id = str(sweep_dir)
        info = read_sweep(sweep_dir)
        parents = client.search_runs(
            [exp_id], f"tags.`{SWEEP_TAG}` = '{sweep_id}' and tags.`rlexp.role` = 'parent'")
        if info is None and parents:
            info = {"parent_run_id": parents[0].info.run_id}
        node = config.hydra.sweeper.get("params")
        params = OmegaConf.to_container(node, resolve=True) if node else {}
        assert isinstance(params, dict)
        varying = varying_keys(list(config.hydra.overrides.task), params)
        if info is None:  # a new sweep
            run = client.create_run(exp_id, run_name=f"sweep {sweep_dir.name}", tags={
                SWEEP_TAG: sweep_id, "rlexp.role": "parent", "rlexp.swept": ",".join(varying),
                "rlexp.overrides": " ".join(config.hydra.overrides.task)})
            info = {"parent_run_id": run.info.run_id}
            log.info("mlflow: sweep parent run %s", run.info.run_id)
        else:  # a sweep dir launched again: same parent
            client.update_run(info["parent_run_id"], status="RUNNING")
            log.info("mlflow: reusing sweep parent run %s", info["parent_run_id"])
        view = save_compare_view(client, exp_id, info["parent_run_id"], varying)
        client.set_tag(info["parent_run_id"], "rlexp.compare_view", view)
        info |= {"experiment_id": exp_id, "tracking_uri": config.logger.tracking_uri,
                 "sweep_id": sweep_id, "varying": varying, "started": time.time(),
                 "jobs": count_jobs(list(config.hydra.overrides.task), params), "compare_view": view}
        (sweep_dir / SWEEP_FILE).write_text(json.dumps(info, indent=1))
        # Hydra skips on_multirun_end when the launcher raises (submitit does when sacct reports
        # a job that died without its result file) or is stopped by Ctrl-C (without sacct,
        # submitit waits for such a job until then): the sweep is closed at exit instead.
        atexit.register(close_sweep, sweep_dir, stopped=True)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        atexit.unregister(close_sweep)
        if not close_sweep(Path(config.hydra.sweep.dir).resolve()):
            raise SystemExit(1)  # every job ran; the sweep as a whole did not succeed


def log_failed_job(cfg: DictConfig, tags: dict[str, str], error: BaseException) -> None:
    """A job that failed before its MLflow run started (e.g. a config error) still gets a
    FAILED child run, so the sweep's table shows it."""
    client, exp_id = _client(cfg)
    run = client.create_run(exp_id, run_name=cfg.logger.get("run_name"),
                            tags=tags | {"rlexp.error": str(error)[:4000]})
    client.set_terminated(run.info.run_id, status="FAILED")
