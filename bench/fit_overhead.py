"""rlexp's fit over its floor: a bare forward+backward+AdamW on the same tokens.

    .venv/bin/python bench/fit_overhead.py [--reps 7] [trainer.key=value ...]

The batch is one step of the default experiment (32 prompts x 8 samples, generated with
the transformers engine). The floor is the least any trainer must do with it: one padded
[N, L] forward of the model, log-softmax, the chosen tokens' logprobs, a masked mean,
backward, gradient clipping, AdamW. The reference forward is added to the floor on the
steps where rlexp runs one (`train/kl`). Also timed, same tokens: the layouts a trainer
could use (padded, packed rows one at a time as rlexp did before, packed rows stacked).
Repetitions alternate rlexp and floor; medians. `--also OVERRIDE ...` times a second trainer
with those overrides in the same repetitions (e.g. `trainer.logits_chunk_tokens=8192`: the
head scored whole, as the floor does, against rlexp's default chunks); `--fit-only` skips the
packed layouts and the floor's reference forward.

Run it against another checkout (e.g. before a change) with that checkout first on the
path: `PYTHONPATH=/path/to/old .venv/bin/python bench/fit_overhead.py`.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from hydra.utils import instantiate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import default_config, default_model, median, one_step_batch  # noqa: E402

from rlexp.sample import Status  # noqa: E402


def padded(batch) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [s for s in batch if s.status == Status.COMPLETED and s.response_length]
    width = max(len(s.tokens) for s in rows)
    ids = torch.tensor([s.tokens + [0] * (width - len(s.tokens)) for s in rows])
    mask = torch.tensor([s.loss_mask + [0] * (width - len(s.tokens)) for s in rows], dtype=torch.float32)
    return ids, mask[:, 1:]


def packed_rows(batch, row_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """First-fit packing into rows of `row_tokens`, position ids restarting per sequence."""
    rows: list[tuple[list[int], list[int]]] = []
    for s in sorted(batch, key=lambda s: -len(s.tokens)):
        for ids, pos in rows:
            if len(ids) + len(s.tokens) <= row_tokens:
                ids += s.tokens
                pos += range(len(s.tokens))
                break
        else:
            rows.append((list(s.tokens), list(range(len(s.tokens)))))
    return [(torch.tensor([i]), torch.tensor([p])) for i, p in rows]


def lm_loss(model, ids, position_ids=None, mask=None) -> torch.Tensor:
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    return -(logp * mask).sum() / mask.sum() if mask is not None else -logp.mean()


class Floor:
    def __init__(self, model_path: str, cfg):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path).train()
        self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.opt = instantiate(cfg.trainer.optimizer)(self.model.parameters())

    def step(self, loss: torch.Tensor) -> None:
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def padded(self, ids, mask, ref: bool = False) -> None:
        if ref:
            with torch.no_grad():
                self.ref(input_ids=ids, use_cache=False)
        self.step(lm_loss(self.model, ids, mask=mask))

    def packed_one_at_a_time(self, rows) -> None:
        for ids, pos in rows:
            lm_loss(self.model, ids, pos).backward()
        self.step(torch.zeros((), requires_grad=True))

    def packed_stacked(self, rows) -> None:
        width = max(ids.shape[1] for ids, _ in rows)
        ids = torch.cat([torch.nn.functional.pad(i, (0, width - i.shape[1])) for i, _ in rows])
        pos = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for _, p in rows])
        self.step(lm_loss(self.model, ids, pos))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--also", nargs="+", default=[], metavar="OVERRIDE",
                   help="also time a second trainer with these overrides on top, alternating with the "
                        "others (e.g. trainer.logits_chunk_tokens=8192: the head scored whole)")
    p.add_argument("--fit-only", action="store_true",
                   help="only the fit and the floor (no packed layouts; no reference forward in the floor)")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. trainer.kl.coef=0.1")
    args = p.parse_args()
    torch.manual_seed(0)
    # the same batch is fitted again and again as version 0: after the first update the check
    # would see the trainer ahead of the engine that made it, so it only measures, as it costs
    cfg = default_config(["trainer.sync_check.bound=off", *args.overrides])
    model_path = default_model(cfg)
    batch = one_step_batch(cfg, model_path)
    trainer = instantiate(cfg.trainer, model_path=model_path)
    also = instantiate(default_config(["trainer.sync_check.bound=off", *args.overrides, *args.also]).trainer,
                       model_path=model_path) if args.also else None
    floor = Floor(model_path, cfg)
    ids, mask = padded(batch)
    rows = packed_rows(batch, 512)
    n_tokens = sum(len(s.tokens) for s in batch)
    print(f"batch: {len(batch)} samples, {n_tokens} tokens, padded {tuple(ids.shape)}, "
          f"{len(rows)} packed rows of <= 512; torch threads {torch.get_num_threads()}")

    import time
    sides = {"fit": lambda: trainer.fit(batch, 0), "floor": lambda: floor.padded(ids, mask),
             "floor+ref": lambda: floor.padded(ids, mask, ref=True),
             "packed_one_at_a_time": lambda: floor.packed_one_at_a_time(rows),
             "packed_stacked": lambda: floor.packed_stacked(rows)}
    if args.fit_only:
        sides = {k: sides[k] for k in ("fit", "floor")}
    if also is not None:
        sides["fit " + " ".join(args.also)] = lambda: also.fit(batch, 0)
    times: dict[str, list[float]] = {k: [] for k in sides}
    kl_steps = 0
    for rep in range(args.reps + 1):  # the first round warms up, untimed
        for name, fn in sides.items():
            t0 = time.perf_counter()
            out = fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
                kl_steps += name == "fit" and "train/kl" in out
    print(f"{'':22} {'median s':>9}  all")
    for name, ts in times.items():
        print(f"{name:22} {median(ts):9.3f}  " + " ".join(f"{t:.3f}" for t in ts))
    fit, floor_s = median(times["fit"]), median(times["floor"])
    print(f"fit ran the reference forward on {kl_steps} of {args.reps} steps (train/kl)")
    if not args.fit_only:
        print(f"padded vs packed rows one at a time: {median(times['packed_one_at_a_time']) / floor_s:.2f}x "
              f"the padded time; packed rows stacked: {median(times['packed_stacked']) / floor_s:.2f}x")
    base = median(times["floor+ref"]) if "floor+ref" in times and kl_steps > args.reps // 2 else floor_s
    if also is not None:
        print(f"fit {' '.join(args.also)} over the floor: {median(times[list(sides)[-1]]) / base:.3f}")
    print(f"ratio: {fit / base:.3f}")


if __name__ == "__main__":
    main()
