"""The command line: compose (Hydra) -> validate -> hand over to the loop -> exit code.

    python -m rlexp.run [group=option ...] [key=value ...]
    python -m rlexp.run -m scheduler.staleness_threshold=0,1,2,4     (a sweep; see README)

Exit codes: 0 done, 2 bad config or input (nothing started), 3 the run stopped (too many
failed samples, the engine died, or an agent or judge raised a programming error, printed
with its traceback; the message says how to resume), 143 / 130 SIGTERM / SIGINT stopped it
(128 + the signal's number; the MLflow run is KILLED; rlexp/signals.py)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlexp import orphans
from rlexp.config import ALGORITHM_GROUPS, resume_config, validate
from rlexp.console import quiet_third_party
from rlexp.errors import ConfigError, Interrupted, ProgrammingError, RunStopped
from rlexp.preflight import preflight
from rlexp.progress import SweepPosition
from rlexp.tracking.sweep import SWEEP_TAG, job_run_name, log_failed_job, read_sweep

log = logging.getLogger("rlexp")


def sweep_job_tags(cfg: DictConfig, info: dict | None) -> dict[str, str]:
    """In a Hydra multirun: nest this job's MLflow run under the sweep's parent run and name
    it by what differs between the jobs (`staleness_threshold=2`)."""
    hc = HydraConfig.get()
    if info is None:
        return {}
    overrides = list(hc.overrides.task)
    if cfg.logger.get("run_name") is None:
        cfg.logger.run_name = job_run_name(info["varying"], overrides)
    return {"mlflow.parentRunId": info["parent_run_id"], SWEEP_TAG: info["sweep_id"],
            "rlexp.role": "job", "rlexp.job_num": str(hc.job.num),
            "rlexp.overrides": " ".join(overrides), "rlexp.job_dir": hc.runtime.output_dir}


@hydra.main(version_base="1.3", config_path="pkg://rlexp.conf", config_name="config")  # conf/, packaged
def main(cfg: DictConfig) -> float | None:
    quiet_third_party()
    orphans.use_temp_root()  # $RLEXP_TEMP_DIR: every temporary file of the run in one place
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    info = read_sweep(hc.sweep.dir) if multirun else None
    tags = sweep_job_tags(cfg, info)
    sweep = SweepPosition(hc.job.num, info.get("jobs", 0), info.get("started", time.time()),
                          cfg.logger.run_name) if info else None
    overrides = list(hc.overrides.task)
    if cfg.logger.get("run_name") is None:
        cfg.logger.run_name = ",".join(overrides) if overrides else "default"
    if not cfg.get("resume"):  # a resumed run keeps the choices saved with its config
        cfg.algorithm = {g: hc.runtime.choices.get(g) for g in (*ALGORITHM_GROUPS, "recipe")}
    try:
        run_dir, resume_from = Path(hc.runtime.output_dir), None
        if cfg.get("resume"):  # the interrupted run's own config, its dir, its newest checkpoint
            cfg, run_dir, resume_from = resume_config(cfg.resume, overrides, Path(hc.run.dir).parent)
        inputs = preflight(cfg)  # bad config or data fails here, in about a second
        from rlexp.loop import RLLoop  # torch, transformers: seconds

        validate(cfg, images=inputs.has_images)  # what only the imported components can tell
        final = asyncio.run(RLLoop(cfg, run_dir, sweep).execute(tags, resume_from, inputs))
    except ConfigError as e:
        print(f"rlexp: config error: {e}", file=sys.stderr)
        if not multirun:
            sys.exit(2)
        if tags:
            log_failed_job(cfg, tags, e)  # failed before its MLflow run started
        return None  # the sweep goes on
    except RunStopped as e:
        if isinstance(e, ProgrammingError):
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        print(f"rlexp: run stopped: {e}", file=sys.stderr)
        if isinstance(e, Interrupted):  # meant for the whole process: a sweep stops too
            sys.exit(e.exit_code)
        if not multirun:
            sys.exit(3)
        return None
    except Exception:
        if not multirun:
            raise
        # A failed job must not stop the sweep: its MLflow run is already marked FAILED.
        log.exception("job %s (%s) failed", hc.job.num, cfg.logger.run_name)
        return None
    return final.get("eval/accuracy")


def cli() -> None:
    """The `rlexp` command: `rlexp tinker ...` serves the Tinker API (rlexp/tinker/), anything
    else runs an experiment (`main`)."""
    if sys.argv[1:2] == ["tinker"]:
        from rlexp.tinker.__main__ import main as tinker

        sys.argv = [f"{sys.argv[0]} tinker", *sys.argv[2:]]
        tinker()
    else:
        main()


if __name__ == "__main__":
    main()
