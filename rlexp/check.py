"""A mismatch certificate for one configuration: the rollout engine's logprobs against the
trainer's, at the engine's initial load, after one weight sync and after two, for the
configured model, dtypes, weight transport, LoRA, MoE routing replay and agent.

    python -m rlexp.check [--out DIR] [--prompts N] [--samples N] [group=option ...] [key=value ...]
    python -m rlexp.check model=arch model.family=llama rollout.dtype=bfloat16 trainer.dtype=bfloat16
    python -m rlexp.check experiment=moe                 (MoE, routing captured and replayed)

The overrides are rlexp.run's: the same Hydra config (conf/), composed and checked the same
way before anything starts (rlexp.preflight, rlexp.config.validate). The check's own options
are flags, read before Hydra sees the rest (they are no config keys):
    --out DIR      where certificate.json and certificate.md go (default outputs/check/<time>/)
    --prompts N    prompts per rollout batch (default 2)
    --samples N    samples per prompt, >= 2 (default: data.samples_per_prompt of the config)

What it does, with the loop's own builders (rlexp/loop.py: RLLoop's setup_inputs and
setup_components, rl_step; no MLflow run): for policy versions 0, 1, 2 it rolls out a small
batch with the configured agent and, when that agent is single-turn, one with agent=multiturn
(judge=multiturn) too, and scores every trained token the engine generated at that version
with the trainer (rlexp/certificate.py). Between versions it runs the loop's step: a real
update (the trainer's fit on the configured agent's batch; where that batch carries no
signal, as a random-weight model's never does, on stand-in rewards alternately 0 and 1 in
each group, recorded as such) and the weight sync. The bound is the one the run's in-run
check would use (trainer.sync_check.bound, rlexp.trainer.sync_check.resolve_bound; when that
is `off`, the `auto` bound); the check turns the in-run check off in its own trainer, so a
sync past the bound is measured and reported rather than stopping the fit.

Exit codes: 0 every stage within the bound; 1 a stage past it (or with no token to compare);
2 bad config or input (nothing started); 3 the check stopped (the engine died, a sync hung)."""

from __future__ import annotations

import asyncio
import logging
import shlex
import sys
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from rlexp.config import ALGORITHM_GROUPS, validate
from rlexp.console import quiet_third_party
from rlexp.errors import ConfigError, ProgrammingError, RunStopped
from rlexp.preflight import Inputs, preflight

log = logging.getLogger("rlexp")
SINGLE_TURN = "rlexp.agents.single_turn.SingleTurnAgent"
FLAGS = ("--out", "--prompts", "--samples")


@dataclass
class Options:
    out: Path
    prompts: int = 2
    samples: int | None = None  # None: the config's data.samples_per_prompt


def parse_args(argv: list[str]) -> tuple[Options, list[str]]:
    """The check's flags (`--out DIR` or `--out=DIR`, ...) and the Hydra overrides."""
    found: dict[str, str] = {}
    overrides: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in FLAGS:
            value = value if eq else next(args, "")
            if not value:
                raise ConfigError(f"{name} needs a value")
            found[name] = value
        elif arg.startswith("-"):
            raise ConfigError(f"{arg}: rlexp.check takes --out DIR, --prompts N, --samples N and rlexp.run's "
                              "overrides (no sweeps: one configuration per certificate)")
        else:
            overrides.append(arg)
    default_out = Path("outputs/check") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    opts = Options(Path(found.get("--out", default_out)))
    for flag, least in (("--prompts", 1), ("--samples", 2)):
        if flag in found:
            value = found[flag]
            if not value.isdigit() or int(value) < least:
                raise ConfigError(f"{flag} must be an integer >= {least}, got {value!r}"
                                  + (" (a group's advantages compare its samples)" if least == 2 else ""))
            setattr(opts, flag[2:], int(value))
    return opts, overrides


def compose_config(overrides: list[str]) -> tuple[DictConfig, dict[str, Any]]:
    """The config rlexp.run composes from `overrides`, and the config groups' choices."""
    try:
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(" ".join(str(e).split(" Config search path:")[0].split())) from None
    choices: dict[str, Any] = {str(k): v for k, v in cfg.hydra.runtime.choices.items()}
    with open_dict(cfg):
        del cfg["hydra"]
    cfg.algorithm = {g: choices.get(g) for g in (*ALGORITHM_GROUPS, "recipe")}  # as rlexp.run sets it
    return cfg, choices


def load_configs(overrides: list[str]) -> tuple[DictConfig, DictConfig | None, str]:
    """The configured setup; the multi-turn one (agent=multiturn, judge=multiturn, the other
    overrides as given) when the configured agent is single-turn, else None; the agent's name."""
    for o in overrides:
        if o.split("=", 1)[0].lstrip("+~") == "resume":
            raise ConfigError(f"{o}: rlexp.check certifies a configuration, not a run: no resume")
    with initialize_config_module(config_module="rlexp.conf", version_base="1.3"):
        cfg, choices = compose_config(overrides)
        multi = None
        if OmegaConf.select(cfg, "agent._target_") == SINGLE_TURN:
            kept = [o for o in overrides if not o.lstrip("+~").startswith(("agent", "judge"))]
            multi = compose_config([*kept, "agent=multiturn", "judge=multiturn"])[0]
    return cfg, multi, str(choices.get("agent") or "agent")


def run_bound(cfg: DictConfig) -> tuple[float, str]:
    """The p99 bound the run's in-run check would use, and where it comes from."""
    from rlexp.models.local import resolve_dtype
    from rlexp.trainer.sync_check import resolve_bound

    mixed = cfg.trainer.get("mixed_precision", "none")
    dtypes = [str(cfg.rollout.dtype), str(cfg.trainer.dtype if mixed == "none" else mixed)]
    names = " / ".join(sorted({resolve_dtype(d) for d in dtypes}))
    asked = OmegaConf.select(cfg, "trainer.sync_check.bound", default="auto")
    bound = resolve_bound(asked, dtypes)
    if bound is None:
        return float(resolve_bound("auto", dtypes) or 0.0), f"auto, {names}: the run's check is off"
    return bound, f"trainer.sync_check.bound={asked}, {names}"


def prepare(cfg: DictConfig, multi: DictConfig | None, opts: Options) -> tuple[Inputs, float, str]:
    """The run's checks (bad config or data fails here, before any engine starts), then the
    check's sizes; the bound. The check's trainer runs with its in-run check off."""
    if cfg.trainer.get("workers", 1) != 1:
        raise ConfigError(f"trainer.workers={cfg.trainer.workers}: rlexp.check scores the samples with the "
                          "trainer in this process; certify with trainer.workers=1")
    inputs = preflight(cfg)
    if multi is not None:
        validate(multi, static=True)
    import rlexp.loop  # noqa: F401  (torch, transformers: seconds)

    validate(cfg, images=inputs.has_images)  # what only the imported components can tell
    if multi is not None:
        validate(multi, images=inputs.has_images)
    inputs.data.prompts_per_step = opts.prompts
    inputs.data.samples_per_prompt = opts.samples or inputs.data.samples_per_prompt
    bound, source = run_bound(cfg)
    for c in (cfg, multi):
        if c is not None and OmegaConf.select(c, "trainer.sync_check") is not None:
            c.trainer.sync_check.bound = "off"
    return inputs, bound, source


def setup(cfg: DictConfig, choices_agent: str, loop: Any) -> dict[str, Any]:
    """What the certificate says it certifies."""
    import json

    from rlexp.models.local import resolve_dtype

    try:
        arch = json.loads((Path(loop.model_path) / "config.json").read_text())["architectures"][0]
    except (OSError, ValueError, KeyError, IndexError):
        arch = "?"
    lora = OmegaConf.select(cfg, "trainer.lora.rank", default=0) or 0
    return {"model": f"{Path(loop.model_path).name} ({arch})",
            "rollout.dtype": resolve_dtype(str(cfg.rollout.dtype)),
            "trainer.dtype": resolve_dtype(str(cfg.trainer.dtype)),
            "transport": type(loop.transport).__name__, "engine": type(loop.engine).__name__,
            "LoRA rank": lora,
            "routing capture": bool(OmegaConf.select(cfg, "rollout.routing_capture", default=False)),
            "routing replay": OmegaConf.select(cfg, "trainer.routing_replay", default="none"),
            "agent": choices_agent}


class CheckRun:
    """The three stages on the components the loop builds; the figures go into `cert`."""

    def __init__(self, cfg: DictConfig, multi: DictConfig | None, inputs: Inputs, agent: str, cert: Any,
                 out: Path):
        self.cfg, self.multi, self.inputs, self.agent = cfg, multi, inputs, agent
        self.cert, self.out = cert, out

    async def run(self) -> None:
        from rlexp.certificate import STAGES
        from rlexp.cluster import build_cluster
        from rlexp.loop import RLLoop
        from rlexp.schedulers.sync import SyncScheduler
        from rlexp.trainer.controller import TrainController

        loop = RLLoop(self.cfg, self.out)
        loop.setup_inputs(None, self.inputs)
        loop.cluster = build_cluster(self.cfg)  # RLLoop.start_tracking's, less the MLflow run
        loop.cluster.check_readable({"model_path": loop.model_path})
        status, multi_agent = "FAILED", None
        try:
            await loop.setup_components()
            if not isinstance(loop.trainer, TrainController):
                raise ConfigError(f"rlexp.check scores with rlexp's TrainController, not {type(loop.trainer)}"
                                  " (trainer._target_)")
            self.cert.setup = setup(self.cfg, self.agent, loop)
            multi_agent = self.multi_turn_agent(loop) if self.multi is not None else None
            for version in range(len(STAGES)):
                if multi_agent is not None:  # first: the step below ends with the next sync
                    batch = await SyncScheduler().produce_batch(loop.data, multi_agent, version)
                    await asyncio.to_thread(self.measure, loop, batch, version, "multiturn")
                await self.configured(loop, version, last=version == len(STAGES) - 1)
            status = "FINISHED"
        finally:
            if multi_agent is not None:
                await multi_agent.aclose()
            await loop.cleanup(status, None)
        self.cert.stages.sort(key=lambda s: (s.version, s.rollout != self.agent))

    def multi_turn_agent(self, loop: Any) -> Any:
        """agent=multiturn with judge=multiturn, built as the loop builds its agent."""
        from rlexp.guards import AgentGuard, JudgeGuard
        from rlexp.loop import build_guarded

        assert self.multi is not None
        judge = build_guarded(self.multi, "judge", JudgeGuard)
        judge.bind(loop.engine, loop.tokenizer)
        return build_guarded(self.multi, "agent", AgentGuard, engine=loop.engine, tokenizer=loop.tokenizer,
                             judge=judge)

    async def configured(self, loop: Any, version: int, last: bool) -> None:
        """The configured agent's batch at `version`, measured; unless `last`, the loop's step
        on it (its fit measures the batch first, then updates) and the sync to `version + 1`."""
        from rlexp.step import rl_step

        if last:
            batch = await loop.scheduler.produce_batch(loop.data, loop.agent, version)
            await asyncio.to_thread(self.measure, loop, batch, version, self.agent)
            return
        update: dict[str, Any] = {}
        _, metrics = await rl_step(loop.scheduler, loop.data, loop.agent, loop.engine, loop.trainer,
                                   loop.transport, version, partial(self.measured_fit, loop, update),
                                   self.cfg.sync_timeout_s)
        update["sync_s"] = metrics["timing/sync_s"]
        self.cert.updates.append(update)

    def measure(self, loop: Any, batch: list, version: int, rollout: str) -> None:
        from rlexp.certificate import STAGES, StageFigures, measure

        s = measure(loop.trainer, batch, StageFigures(STAGES[version], version, rollout, self.cert.bound))
        self.cert.stages.append(s)
        log.info("check: %s, %s: %d tokens, |logprob diff| max %.3g p99 %.3g mean %.3g%s", s.stage, rollout,
                 s.tokens, s.max, s.p99, s.mean,
                 "" if s.routing_agreement is None else f", routing agreement {s.routing_agreement:.4f}")

    def measured_fit(self, loop: Any, update: dict[str, Any], batch: list, version: int) -> dict[str, float]:
        """The step's update: the batch measured first (the trainer still holds `version`),
        then the fit; on stand-in rewards where the batch's own carry no signal."""
        from rlexp.certificate import STAGES, stand_in_rewards, weight_change

        self.measure(loop, batch, version, self.agent)
        before = {name: t.detach().clone() for name, t in loop.trainer.weights()}
        rewards = [s.reward for s in batch]
        update |= {"before": STAGES[version + 1], "rewards": "rollout",
                   "reward_mean": sum(rewards) / max(1, len(rewards))}
        metrics = loop.update(batch, version)
        if metrics.get("train/skipped_step"):
            stand_in_rewards(batch)
            update["rewards"] = "stand-in"
            metrics = loop.update(batch, version)
        update["grad_norm"] = metrics.get("train/grad_norm", float("nan"))
        update["max_abs_weight_change"] = weight_change(before, loop.trainer.weights())
        return metrics


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    quiet_third_party()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        opts, overrides = parse_args(argv)
        cfg, multi, agent = load_configs(overrides)
        inputs, bound, source = prepare(cfg, multi, opts)
        from rlexp.certificate import Certificate, machine

        cert = Certificate("python -m rlexp.check " + shlex.join(argv), datetime.now().date().isoformat(),
                           machine(), {}, bound, source)
        asyncio.run(CheckRun(cfg, multi, inputs, agent, cert, opts.out).run())
    except ConfigError as e:
        print(f"rlexp.check: config error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        if isinstance(e, ProgrammingError):
            log.exception("a programming error in an agent or judge")
        print(f"rlexp.check: stopped: {e}", file=sys.stderr)
        return 3
    json_path, md_path = cert.write(opts.out)
    print(cert.markdown())
    print(f"rlexp.check: wrote {json_path} and {md_path}", file=sys.stderr)
    return cert.exit_code


if __name__ == "__main__":
    sys.exit(main())
