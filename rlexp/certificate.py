"""The figures of a mismatch certificate (`python -m rlexp.check`, rlexp/check.py) and the
certificate itself, as JSON and as a Markdown table.

Per stage (the engine's initial load, after one sync, after two) and rollout kind: the
trainer's logprob of every token the engine generated at the stage's policy version, loss
mask 1, against the engine's own,

    d_t = | log pi_trainer(y_t) - log pi_engine(y_t) |

as the in-run check measures it (rlexp/trainer/sync_check.py): its count, max, p99, mean and
the share of tokens above the bound; and for an MoE whose engine records its routing
(rollout.routing_capture=true) the routing agreement, the share of (token, MoE layer)
positions where the trainer's own top-k experts are the engine's. A stage is within the
bound when it has tokens and its p99 is at most the bound (the in-run check's rule)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlexp.sample import Sample, Status
from rlexp.trainer.batch import Layout, TrainBatch
from rlexp.trainer.controller import TrainController

STAGES = ("initial load", "sync 1", "sync 2")  # the stage of policy version 0, 1, 2


@dataclass
class StageFigures:
    """One stage x rollout kind. `bound`: the p99 bound (the run's trainer.sync_check bound)."""

    stage: str
    version: int
    rollout: str
    bound: float
    samples: int = 0  # trained samples (completed, with a response)
    turns: int = 0  # the policy's turns over those samples (more than samples: multi-turn)
    tokens: int = 0
    max: float = math.nan
    p99: float = math.nan
    mean: float = math.nan
    share_above: float = math.nan
    routing_agreement: float | None = None
    routing_positions: int = 0  # token x MoE layer positions compared

    @property
    def passed(self) -> bool:
        return self.tokens > 0 and self.p99 <= self.bound

    def add_diffs(self, d: torch.Tensor) -> None:
        """The figures of `d` (1-D |logprob differences|), as the in-run check computes them."""
        d = d.double()
        self.tokens = d.numel()
        if not self.tokens:
            return
        p99 = torch.quantile(d, 0.99) if d.numel() <= 2**24 else d.sort().values[int(0.99 * (d.numel() - 1))]
        self.max, self.p99, self.mean = d.max().item(), float(p99), d.mean().item()
        self.share_above = (d > self.bound).double().mean().item()


def exit_code(stages: list[StageFigures]) -> int:
    """0 when every stage is within its bound, 1 when one is past it or has no token."""
    return 0 if stages and all(s.passed for s in stages) else 1


def policy_turns(sample: Sample) -> int:
    """Spans of consecutive policy tokens (loss mask 1) in the sample."""
    mask = sample.loss_mask
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


@torch.no_grad()
def measure(trainer: TrainController, batch: list[Sample], figures: StageFigures) -> StageFigures:
    """Fill `figures` from `batch`, scored by `trainer` (a TrainController: its policy forward,
    as the fit runs it, micro-batch by micro-batch) at the stage's version. With routing
    recorded, the forward also compares the trainer's own top-k with the engine's experts."""
    scored = [s for s in batch if s.status == Status.COMPLETED and s.response_length]
    figures.samples, figures.turns = len(scored), sum(policy_turns(s) for s in scored)
    if not scored:
        return figures
    policy = trainer.learner.policy
    layout = Layout(micro_batch_tokens=trainer.learner.layout.micro_batch_tokens)  # every row here
    tb = TrainBatch.build(scored, figures.version, layout)
    current = tb.loss_mask.bool() & (tb.staleness == 0)  # generated at this stage's version
    diffs, differs_sum, positions = [], 0.0, 0
    for micro in tb.micro_batches:
        out = policy(tb, micro, entropy=False)
        mask = micro.take(current)
        diffs.append((out.logprobs.float().cpu() - micro.take(tb.rollout_logprobs)).abs()[mask])
        differs = out.routing_differs  # per position: share of MoE layers whose top-k differs
        if differs is not None:
            differs_sum += float(differs.float().cpu()[mask].sum())
            positions += int(mask.sum())
    figures.add_diffs(torch.cat(diffs))
    if positions:
        layers = policy.router_layers
        figures.routing_agreement = 1.0 - differs_sum / positions
        figures.routing_positions = positions * layers
    return figures


@dataclass
class Certificate:
    """What `python -m rlexp.check` found: the setup, the bound, every stage, every update."""

    command: str
    date: str
    machine: str
    setup: dict[str, Any]
    bound: float
    bound_source: str
    stages: list[StageFigures] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return exit_code(self.stages)

    def to_json(self) -> dict[str, Any]:
        stages = [{k: _finite(v) for k, v in asdict(s).items()} | {"passed": s.passed} for s in self.stages]
        return {"command": self.command, "date": self.date, "machine": self.machine, "setup": self.setup,
                "bound": self.bound, "bound_source": self.bound_source, "stages": stages,
                "updates": self.updates, "passed": self.exit_code == 0, "exit_code": self.exit_code}

    def table(self) -> str:
        """The stages as a Markdown table."""
        routing = any(s.routing_agreement is not None for s in self.stages)
        head = ["stage", "rollout", "samples / turns", "tokens", "max", "p99", "mean", "> bound"]
        head += ["routing agreement"] if routing else []
        rows = ["| " + " | ".join(head + ["within bound"]) + " |", "|" + "---|" * (len(head) + 1)]
        for s in self.stages:
            cells = [s.stage, s.rollout, f"{s.samples} / {s.turns}", str(s.tokens), _g(s.max), _g(s.p99),
                     _g(s.mean), _share(s.share_above)]
            if routing:
                cells.append("-" if s.routing_agreement is None else
                             f"{s.routing_agreement:.4f} of {s.routing_positions}")
            rows.append("| " + " | ".join(cells + ["yes" if s.passed else "**NO**"]) + " |")
        return "\n".join(rows)

    def markdown(self) -> str:
        setup = ", ".join(f"{k} {v}" for k, v in self.setup.items())
        lines = [f"`{self.command}`", "", f"{self.date}, {self.machine}. {setup}.", "",
                 f"Bound: p99 <= {self.bound:g} ({self.bound_source}).", "", self.table(), ""]
        for u in self.updates:
            lines.append(f"- update before {u['before']}: {u['rewards']} rewards "
                         f"(mean {u['reward_mean']:.3f}), grad norm {_g(u['grad_norm'])}, "
                         f"max |dw| {_g(u['max_abs_weight_change'])}, sync {u['sync_s']:.2f} s")
        verdict = "every stage within the bound" if self.exit_code == 0 else "PAST THE BOUND"
        return "\n".join(lines + ["", f"Verdict: {verdict} (exit code {self.exit_code})", ""])

    def write(self, directory: Path) -> tuple[Path, Path]:
        directory.mkdir(parents=True, exist_ok=True)
        js, md = directory / "certificate.json", directory / "certificate.md"
        js.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        md.write_text(self.markdown())
        return js, md


def _finite(x: Any) -> Any:
    """NaN (a stage without tokens) as JSON's null."""
    return None if isinstance(x, float) and math.isnan(x) else x


def _g(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.3g}"


def _share(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:.2f}%"


def stand_in_rewards(batch: list[Sample]) -> None:
    """Rewards alternately 0 and 1 within each group: a signal for an update where the batch's
    own rewards carry none (a random-weight model's are all 0)."""
    seen: dict[int, int] = {}
    for s in batch:
        i = seen[s.group_id] = seen.get(s.group_id, -1) + 1
        s.reward = float(i % 2)


def weight_change(before: dict[str, torch.Tensor], after: Iterable[tuple[str, torch.Tensor]]) -> float:
    """The largest |w_after - w_before| over every tensor the engine gets."""
    return max(((t.float() - before[name].float()).abs().max().item() for name, t in after), default=0.0)


def machine() -> str:
    """This machine in words: CPU architecture and cores (AVX-512 where it has it), memory, GPU."""
    import os
    import platform

    import psutil

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    avx = " (AVX-512)" if " avx512f" in flags else ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    memory = psutil.virtual_memory().total / 2**30
    return f"{os.cpu_count()}-core {platform.machine()} CPU{avx}, {memory:.0f} GiB, {gpu}"
