"""The trainer on one device as a torch.distributed group of world size 1 (how the GPU
machine without Ray, Hydra or vLLM drives it): FSDP2 with bf16 compute, gradient
checkpointing, LoRA. On one GPU (nccl; `gpu`, skipped without CUDA) and on the CPU (gloo)."""

import socket
from functools import partial

import pytest
import torch
import torch.distributed as dist

from rlexp.trainer.controller import TrainController
from tests.dist_fit import make_batch
from tests.fakes import UNCHECKED

GPU = pytest.param("cuda", marks=[pytest.mark.gpu,
                                  pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])


# the CPU's gloo group is CI's (a machine with CUDA runs the cuda one: FSDP2 there asks for CUDA streams)
CPU = pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CI's; CUDA here"))


@pytest.fixture(params=[GPU, CPU])
def group(request, monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if request.param == "cuda":
        torch.cuda.set_device(0)
    else:  # the trainer picks CUDA wherever it exists
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backend = "nccl" if request.param == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield request.param
    dist.destroy_process_group()


def _trainer(path, **kw):
    return TrainController(path, temperature=0.7, optimizer=partial(torch.optim.AdamW, lr=1e-4),
                           total_steps=4, ref_kl_every_n_steps=1, sync_check=UNCHECKED, **kw)


def test_fsdp2_bf16_keeps_fp32_master_weights_and_trains(group, tiny_model_path):
    trainer = _trainer(tiny_model_path, mixed_precision="bfloat16", gradient_checkpointing=True)
    params = list(trainer.model.parameters())
    assert all(type(p).__name__ == "DTensor" and p.dtype == torch.float32 for p in params)
    before = {k: v.clone() for k, v in trainer.weights()}
    metrics = [trainer.fit(make_batch(seed), seed) for seed in range(2)]
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in metrics)
    assert metrics[0]["memory/rank_0/peak_mb"] > 0 and "train/kl" in metrics[1]
    after = dict(trainer.weights())
    assert all(t.device.type == group and t.dtype == torch.float32 for t in after.values())
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0


def test_gradient_checkpointing_gives_the_same_update_on_gpu(group, tiny_model_path):
    results = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        trainer = _trainer(tiny_model_path, gradient_checkpointing=checkpointing)
        trainer.fit(make_batch(0), 0)
        results.append({k: v.float().cpu() for k, v in trainer.weights()})
    assert max((results[0][k] - results[1][k]).abs().max().item() for k in results[0]) < 1e-5


def test_lora_under_fsdp2_trains_only_adapters(group, tiny_model_path):
    trainer = _trainer(tiny_model_path, mixed_precision="bfloat16", lora={"rank": 8})
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    before = {k: v.clone() for k, v in trainer.weights()}
    trainer.fit(make_batch(0), 0)
    trainer.fit(make_batch(1), 1)
    after = dict(trainer.weights())
    assert sorted(after) == sorted(before)
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mixed_precision_in_one_process_autocasts_on_gpu_with_the_head_in_chunks(tiny_model_path):
    """No group: torch.autocast bf16 on CUDA, fp32 master weights; the head scored in chunks."""
    trainer = _trainer(tiny_model_path, mixed_precision="bfloat16", logits_chunk_tokens=64)
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in trainer.model.parameters())
    before = {k: v.clone() for k, v in trainer.weights()}
    metrics = trainer.fit(make_batch(0), 0)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    after = dict(trainer.weights())
    assert all(t.dtype == torch.float32 for t in after.values())
    assert max((after[k] - before[k]).abs().max().item() for k in before) > 0
