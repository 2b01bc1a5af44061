"""What the benches share: the default experiment's config, model and one step's batch."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import DictConfig

import rlexp.config  # registers the config resolvers

CONF = Path(rlexp.config.__file__).resolve().parents[1] / "conf"  # the checkout whose rlexp runs


def default_config(overrides: list[str] = ()) -> DictConfig:
    """The default experiment's composed config (what `python -m rlexp.run` runs)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def default_model(cfg: DictConfig) -> str:
    return instantiate(cfg.model)  # built once, then cached under .cache/models


def one_step_batch(cfg: DictConfig, model_path: str, seed: int = 0):
    """One training step's batch of the default experiment (its prompts, group size,
    sampling and judge), generated with the transformers engine so no vLLM is needed."""
    from transformers import AutoTokenizer

    from rlexp.agents.single_turn import SingleTurnAgent
    from rlexp.data.manager import DataManager
    from rlexp.judges.math_exact import MathExactJudge
    from rlexp.rollout.hf_engine import HFEngine
    from rlexp.schedulers.sync import SyncScheduler

    engine = HFEngine(model_path, seed=seed, temperature=cfg.rollout.temperature,
                      max_response_tokens=cfg.rollout.max_response_tokens)
    agent = SingleTurnAgent(engine, AutoTokenizer.from_pretrained(model_path), MathExactJudge())
    data = DataManager(instantiate(cfg.data.source), cfg.data.prompts_per_step, cfg.data.samples_per_prompt,
                       seed=seed)
    return asyncio.run(SyncScheduler().produce_batch(data, agent, version=0))


def timed(fn: Callable[[], object], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def rlexp_step_times(overrides: list[str], steps: int, workdir: Path) -> list[float]:
    """Run the rlexp loop in this process for `steps` steps of the experiment `overrides`
    describe (MLflow store and checkpoints under `workdir`); `timing/step_s` of each step
    (produce + fit + sync), as the loop logged it."""
    import mlflow

    from rlexp.config import validate
    from rlexp.loop import RLLoop

    cfg = default_config([f"trainer.total_steps={steps}", f"evaluator.every_n_steps={steps}",
                          "checkpoint.every_n_steps=0", f"logger.tracking_uri=sqlite:///{workdir}/mlflow.db",
                          f"logger.artifact_location={workdir}/artifacts", "logger.log_traces=false",
                          *overrides])
    validate(cfg)
    asyncio.run(RLLoop(cfg, workdir / "run").execute())
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.search_runs([client.get_experiment_by_name(cfg.logger.experiment_name).experiment_id],
                             order_by=["attributes.start_time DESC"], max_results=1)[0]
    history = sorted(client.get_metric_history(run.info.run_id, "timing/step_s"), key=lambda m: m.step)
    return [m.value for m in history]
