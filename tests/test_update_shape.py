"""The update's shape, asserted (docs/architecture.md, "One update"): the calls from
`TrainController.fit` down to `loss.backward()` (the loop's `rl_step` is one more above it:
four from the loop's `for step`), and the rlexp files whose code runs in a GRPO fit: the
five that hold what it computes, and those around them that only measure it, distribute it,
step its lr schedule or hand it the samples' fields."""

from __future__ import annotations

import sys
import traceback
from functools import partial
from pathlib import Path

import torch

import rlexp
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.trainer.controller import TrainController
from tests.fakes import UNCHECKED

ROOT = Path(rlexp.__file__).resolve().parent.parent
COMPUTES = {"rlexp/trainer/update.py", "rlexp/trainer/batch.py", "rlexp/trainer/policy.py",
            "rlexp/algorithms/objective.py", "rlexp/algorithms/advantages.py"}
AROUND = {
    "rlexp/trainer/controller.py": "the entry: TrainController.fit",
    "rlexp/trainer/fit_metrics.py": "measurement (FitObserver)",
    "rlexp/trainer/metric_sums.py": "measurement (sums on the device)",
    "rlexp/trainer/sync_check.py": "measurement (the weight-sync check)",
    "rlexp/trainer/distributed.py": "ranks (in one process: identities)",
    "rlexp/trainer/schedule.py": "the lr schedule's factor (torch's LambdaLR calls it)",
    "rlexp/sample.py": "the samples' fields (Sample properties)",
}
def _grpo(path: str) -> TrainController:
    """The default algorithm (GRPO, PPO-clip, token mean, no mismatch correction), logging
    train/kl on every fit so the reference's forward runs too."""
    torch.manual_seed(0)
    return TrainController(path, temperature=1.0, optimizer=partial(torch.optim.AdamW, lr=1e-3),
                           total_steps=4, ref_kl_every_n_steps=1, micro_batch_tokens=40, sync_check=UNCHECKED)


def _batch(n: int = 8) -> list[Sample]:
    """Two prompts x 4 samples of random tokens, rewards 1 and 0 in each group."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        tokens = torch.randint(10, 120, (5 + 3 + i % 4,), generator=g).tolist()
        mask = [0] * 5 + [1] * (len(tokens) - 5)
        out.append(Sample(group_id=i // 4, prompt=[], answer="", reward=float(i % 2),
                          trace=TokenTrace(tokens, mask, [0.0] * len(tokens)), status=Status.COMPLETED))
    return out


def _rlexp(filename: str) -> str | None:
    path = Path(filename).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT / "rlexp") else None


def test_backward_is_two_calls_below_fit(tiny_model_path, monkeypatch):
    """Every micro-batch's backward is called from `forward_backward`, called by `update.fit`,
    called by `TrainController.fit`: nothing in between."""
    trainer, stacks = _grpo(tiny_model_path), []
    real = torch.Tensor.backward

    def recording(self, *args, **kwargs):
        frames = [f for f in traceback.extract_stack()[:-1] if _rlexp(f.filename)]
        stacks.append([f"{_rlexp(f.filename)}:{f.name}" for f in frames])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "backward", recording)
    trainer.fit(_batch(), 0)
    assert len(stacks) > 1  # micro_batch_tokens=40: several micro-batches
    assert all(s == ["rlexp/trainer/controller.py:fit", "rlexp/trainer/update.py:fit",
                     "rlexp/trainer/update.py:forward_backward"] for s in stacks), stacks[0]


def test_a_grpo_fit_runs_code_from_five_files_and_the_ones_around_them(tiny_model_path):
    trainer, batch = _grpo(tiny_model_path), _batch()
    ran: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and (name := _rlexp(frame.f_code.co_filename)):
            ran.add(name)

    sys.setprofile(profile)
    try:
        metrics = trainer.fit(batch, 0)
    finally:
        sys.setprofile(None)
    assert "train/kl" in metrics and metrics["train/skipped_step"] == 0  # every stage did work
    assert ran & COMPUTES == COMPUTES
    assert ran - COMPUTES <= set(AROUND), sorted(ran - COMPUTES - set(AROUND))
