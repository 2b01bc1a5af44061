"""Fit fixed batches with TrainController on however many ranks launched it (torchrun, gloo):
the trainer driven without Ray, Hydra or vLLM. Used by tests/test_distributed_trainer.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist_fit.py MODEL OUT [--load D] [--save D]

Without torchrun it runs unsharded in one process. Writes {config: {"metrics", "weights"}}
to OUT from rank 0, for minibatches_per_step 1 and 2 ("weights": what the engine would get).
`--vlm`: MODEL is a vision-language model (rlexp/models/vlm.py), the batches carry images."""

from __future__ import annotations

import argparse
import os
import random
from functools import cache, partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image, ImageDraw
from transformers import AutoConfig, AutoTokenizer

from rlexp.algorithms.advantages import GroupNormalized
from rlexp.algorithms.gae import GAE
from rlexp.algorithms.objective import (
    KLTerm,
    SeqMeanTokenMean,
    SeqMeanTokenSum,
    SeqMeanTokenSumNorm,
    TokenMean,
)
from rlexp.chat.images import ImagePrompts
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.trainer import distributed
from rlexp.trainer.controller import TrainController
from rlexp.trainer.critic import Critic
from rlexp.trainer.sync_check import SyncCheck

AGGREGATIONS = {"token_mean": TokenMean(), "seq_mean_token_sum": SeqMeanTokenSum(),
                "seq_mean_token_mean": SeqMeanTokenMean(), "seq_mean_token_sum_norm": SeqMeanTokenSumNorm(16)}


def make_batch(seed: int, groups: int = 4, per_group: int = 4, routing: tuple[int, int, int] | None = None
               ) -> list[Sample]:
    """Prompts and responses of random lengths (so ranks get unequal rows), random rewards;
    with `routing` (MoE layers, experts, k) random expert ids per position, to replay."""
    g, routing_rng = random.Random(seed), random.Random(-1 - seed)  # the batch is the same with or without
    out = []
    for gid in range(groups):
        for _ in range(per_group):
            n_prompt, n_resp = g.randint(3, 8), g.randint(2, 14)
            tokens = [g.randint(5, 100) for _ in range(n_prompt + n_resp)]
            logprobs = [0.0] * n_prompt + [-g.random() * 3 for _ in range(n_resp)]
            s = Sample(group_id=gid, prompt=tokens[:n_prompt], answer="",
                       trace=TokenTrace(tokens, [0] * n_prompt + [1] * n_resp, logprobs, [0] * len(tokens)))
            s.reward, s.status = float(g.random() > 0.5), Status.COMPLETED
            if routing:
                layers, experts, k = routing
                ids = [[routing_rng.sample(range(experts), k) for _ in range(layers)] for _ in tokens[1:]]
                s.trace.routed_experts = np.array(ids, dtype=np.uint8)
            out.append(s)
    return out


@cache
def _image_prompts(model: str) -> ImagePrompts:
    return ImagePrompts(AutoTokenizer.from_pretrained(model))


def make_vlm_batch(model: str, seed: int, groups: int = 4, per_group: int = 4) -> list[Sample]:
    """Image prompts rendered by `model`'s processor (1 or 2 pictures of random circles, some
    not square: padded pixels; each image's tokens expanded), random responses and rewards;
    each sample carries its pixel inputs (`mm_train_info`) as an agent's rollout leaves them."""
    g = random.Random(seed)
    out = []
    for gid in range(groups):
        for j in range(per_group):
            images = []
            for _ in range(1 + (gid + j) % 2):
                img = Image.new("RGB", g.choice([(64, 64), (96, 72), (48, 80)]), "white")
                for _ in range(g.randint(1, 3)):
                    x, y, color = g.randint(0, 40), g.randint(0, 40), g.choice(["red", "blue", "green"])
                    ImageDraw.Draw(img).ellipse((x, y, x + 16, y + 16), fill=color)
                images.append(img)
            content = [*({"type": "image", "image": img} for img in images),
                       {"type": "text", "text": g.choice(["How many circles?", "Which colour?"])}]
            _, prompt, _, pixels = _image_prompts(model)([{"role": "user", "content": content}])
            n_resp = g.randint(2, 14)
            tokens = prompt + [g.randint(5, 100) for _ in range(n_resp)]
            logprobs = [0.0] * len(prompt) + [-g.random() * 3 for _ in range(n_resp)]
            s = Sample(group_id=gid, prompt=[], answer="", trace=TokenTrace(
                tokens, [0] * len(prompt) + [1] * n_resp, logprobs, [0] * len(tokens)))
            s.reward, s.status, s.mm_train_info = float(g.random() > 0.5), Status.COMPLETED, pixels
            out.append(s)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--fits", type=int, default=2)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--load")
    p.add_argument("--save")
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--minibatches", default="1,2")
    p.add_argument("--aggregation", default="token_mean", choices=list(AGGREGATIONS))
    p.add_argument("--micro-batch-tokens", type=int, default=40)
    p.add_argument("--kl-where", default="loss", choices=["loss", "reward"])
    p.add_argument("--critic", action="store_true", help="PPO: GAE with a critic")
    p.add_argument("--routing-replay", action="store_true", help="MoE: replay random routing")
    p.add_argument("--vlm", action="store_true", help="a vision-language model: batches with images")
    p.add_argument("--freeze-vision", action="store_true", help="trainer.freeze_vision")
    a = p.parse_args()
    routing = None
    if a.routing_replay:
        config = AutoConfig.from_pretrained(a.model)
        routing = (config.num_hidden_layers, config.num_experts, config.num_experts_per_tok)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    results = {}
    for mb in map(int, a.minibatches.split(",")):
        torch.manual_seed(0)
        # Adam's eps raised from 1e-8: a weight whose gradient is ~1e-8 turns the summation-order
        # noise of its gradient (1e-13) into a step difference of ~1e-5; the trainer is not at fault
        optimizer = partial(torch.optim.AdamW, lr=1e-3, eps=1e-6)
        trainer = TrainController(a.model, temperature=0.7, optimizer=optimizer, total_steps=10,
                                  workers=world, minibatches_per_step=mb,
                                  micro_batch_tokens=a.micro_batch_tokens,
                                  kl=KLTerm(coef=0.05, where=a.kl_where),
                                  aggregation=AGGREGATIONS[a.aggregation], old_logprobs="recompute",
                                  lora={"rank": a.lora_rank},
                                  advantage=GAE(lam=0.95) if a.critic else GroupNormalized(),
                                  critic=partial(Critic, optimizer=optimizer) if a.critic else None,
                                  routing_replay="rollout" if routing else "none",
                                  freeze_vision=a.freeze_vision, sync_check=partial(SyncCheck, bound="off"),
                                  logits_chunk_tokens=16)  # FSDP2 with the head checkpointed per chunk
        if a.load:
            trainer.load(Path(a.load) / f"mb{mb}")
        batches = [make_vlm_batch(a.model, a.first_seed + i) if a.vlm
                   else make_batch(a.first_seed + i, routing=routing) for i in range(a.fits)]
        metrics = [trainer.fit(batch, a.first_seed + i) for i, batch in enumerate(batches)]
        if a.save:
            (Path(a.save) / f"mb{mb}").mkdir(parents=True, exist_ok=True)
            trainer.save(Path(a.save) / f"mb{mb}")
        weights = {name: t.detach().cpu().clone() for name, t in trainer.weights()}  # every rank gathers
        if trainer.critic:  # gathered on every rank too
            weights |= {f"critic.{n}": distributed.full_tensor(t).detach().cpu().clone()
                        for n, t in trainer.critic.model.state_dict().items()}
        results[mb] = {"metrics": metrics, "weights": weights}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, a.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
