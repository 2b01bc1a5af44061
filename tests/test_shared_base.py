"""LoRA trainers of one process share their frozen base (rlexp/trainer/shared_base.py): one
copy in memory, each trainer's update its own, and nothing kept once the trainers are gone."""

from __future__ import annotations

import gc

import torch

from rlexp.trainer import shared_base
from rlexp.trainer.controller import TrainController
from tests.dist_fit import make_batch
from tests.fakes import UNCHECKED


def _trainer(path: str, rank: int) -> TrainController:
    torch.manual_seed(0)
    return TrainController(path, temperature=1.0, total_steps=2, ref_kl_every_n_steps=0,
                           lora={"rank": rank} if rank else None,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), sync_check=UNCHECKED)


def _frozen(trainer) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in trainer.model.named_parameters() if not p.requires_grad}


def _logprobs(trainer, samples) -> list[torch.Tensor]:
    with torch.no_grad():
        return [lp.clone() for lp in trainer.sample_logprobs(samples)]


def test_lora_trainers_share_one_frozen_base_and_train_apart(tiny_model_path):
    first, second = _trainer(tiny_model_path, 4), _trainer(tiny_model_path, 4)
    a, b = _frozen(first), _frozen(second)
    assert a.keys() == b.keys() and a
    assert all(a[n].data_ptr() == b[n].data_ptr() for n in a)  # one storage per base tensor
    pairs = zip(first.model.parameters(), second.model.parameters())
    assert all(p.data_ptr() != q.data_ptr() for p, q in pairs if p.requires_grad)  # adapters of their own
    samples = make_batch(1, groups=2, per_group=4)
    before = _logprobs(second, samples)
    base = {n: p.detach().clone() for n, p in a.items()}
    first.fit(samples, 0)
    first.fit(samples, 1)
    assert all(torch.equal(base[n], p) for n, p in a.items())  # the update moved adapters only
    after = _logprobs(second, samples)
    assert all(torch.equal(x, y) for x, y in zip(before, after))  # the other tenant is untouched
    assert any(not torch.equal(x, y) for x, y in zip(before, _logprobs(first, samples)))


def test_full_fine_tunes_keep_their_own_weights_and_a_base_goes_with_its_trainers(tiny_model_path):
    full = [_trainer(tiny_model_path, 0) for _ in range(2)]
    ptrs = [{n: p.data_ptr() for n, p in t.model.named_parameters()} for t in full]
    assert all(ptrs[0][n] != ptrs[1][n] for n in ptrs[0])  # trained weights are never shared
    lora = _trainer(tiny_model_path, 4)
    key = next(k for k in shared_base._LIVE if k[0].endswith(tiny_model_path.rstrip("/").split("/")[-1]))
    assert any(len(s) for s in shared_base._LIVE[key].values())
    del lora
    gc.collect()
    assert not any(len(s) for s in shared_base._LIVE[key].values())  # nothing holds a base of its own
