"""What the trainer needs from torch.distributed, in one place.

Without an initialised process group (`cluster=local`, one worker) everything here is the
identity: rank 0 of 1, the model unsharded, tensors already full. With one (the Ray trainer
group, rlexp/cluster/trainer_group.py, or any launcher that calls `init_process_group`)
every rank holds an FSDP2 shard of the model and sees the whole batch; it trains its own
token-balanced share of the rows."""

from __future__ import annotations

import resource
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rlexp.weights.files import save_safetensors


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def sharded() -> bool:
    """A process group exists: the model is sharded over its ranks (also over one rank)."""
    return dist.is_available() and dist.is_initialized()


def device() -> torch.device:
    """This rank's device: its GPU (one per rank; Ray or the launcher sets which is visible)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def shard(model: torch.nn.Module, mixed_precision: str | None) -> None:
    """FSDP2 (`fully_shard`) per decoder layer, then the rest. Gradients are summed over the
    ranks, not averaged: the loss is already divided by the global token count."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if mixed_precision:  # compute in bf16, master weights and gradient reductions in fp32
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, mixed_precision), reduce_dtype=torch.float32)
    layer_types = tuple(getattr(model, "_no_split_modules", None) or ())
    for module in model.modules():
        if type(module).__name__ in layer_types:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():  # each FSDP unit reduces its own gradients
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) parameter gathered whole on every rank (a collective); a plain
    tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def balanced_split(rows: list[int], lengths: list[int], world: int) -> list[list[int]]:
    """`rows` dealt to `world` ranks balanced by token count (longest first, each to the rank
    with the fewest tokens so far; ties to the lowest rank). Deterministic: every rank computes
    every rank's share, so no communication is needed to agree on it."""
    if world == 1:
        return [list(rows)]
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(rows, key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shares]


def all_reduce_(t: torch.Tensor, op: str) -> torch.Tensor:
    """Sum or max over the ranks, in place (no-op on one rank)."""
    if rank_world()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def all_gather_1d(t: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-d `t` (lengths may differ), concatenated in rank order (itself on one rank)."""
    rank, world = rank_world()
    if world == 1:
        return t
    counts = torch.zeros(world, dtype=torch.long, device=t.device)
    counts[rank] = t.numel()
    all_reduce_(counts, "sum")
    out = torch.zeros(int(counts.sum()), dtype=t.dtype, device=t.device)
    start = int(counts[:rank].sum())
    out[start:start + t.numel()] = t
    return all_reduce_(out, "sum")


def reset_peak_memory(dev: torch.device) -> None:
    """Start counting the peak anew (a fit's: `peak_memory_mb` at its end)."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def peak_memory_mb(dev: torch.device) -> float:
    """Peak allocated GPU memory on CUDA; peak resident memory of this process on CPU."""
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole optimizer state keyed by parameter name (gathered on rank 0 when sharded), so
    a checkpoint loads into any number of ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=sharded()))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not state["state"]:  # a stateless optimizer (plain SGD): torch's loader needs a tensor in it
        return
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def load_model_state(model: torch.nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Full tensors by name into a plain or sharded model (each rank keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def save_whole(named, directory: Path, filename: str, rank: int) -> None:
    """Named tensors, each gathered whole as it is reached (a collective: every rank drains
    the iterator), written by rank 0 as one safetensors file.

    Not `torch.distributed.checkpoint` (DCP), because the whole file is the contract: a
    checkpoint's `model.safetensors` loads into any number of workers (`load_model_state`) and,
    as it is, into the engines (`read_shared`: rollout=hf, vLLM's `reload_weights`). DCP's default
    writer leaves per-rank `.distcp` shards and a `.metadata` file that only DCP reads back;
    its `HuggingFaceStorageWriter` (torch 2.13) writes safetensors shards per rank and, with
    `enable_consolidation=True`, rank 0 then reads them all back to write
    `model-0000N-of-0000M.safetensors`: the same whole files after writing and reading the model
    once more, under other names, without this file's atomic rename, tied-tensor copies or the
    LoRA merge (`policy_weights` yields merged tensors by the base model's names)."""
    if rank == 0:
        save_safetensors(named, directory, filename)
    else:
        deque(named, maxlen=0)


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler, path: Path,
                   rank: int) -> None:
    """The optimizer by parameter name (gathered: every rank calls it) and the lr schedule,
    written by rank 0, so any number of workers can load them."""
    state = optimizer_state(model, optimizer)
    if rank == 0:
        torch.save({"optimizer": state, "lr_scheduler": lr_scheduler.state_dict()}, path)

