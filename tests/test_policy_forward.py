"""The chunked head (rlexp/trainer/policy.py): scored in chunks of positions, the
logprobs, entropies and gradients are the one-chunk computation's (fp32, to a few ulps), on a
dense model, LoRA, an MoE with routing replay and a VLM with its placeholders masked; and no
buffer of the vocabulary's width ever holds more than one chunk of positions, forward or
backward. Mixed precision in one process computes in bf16 and keeps fp32 master weights."""

from contextlib import nullcontext
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlexp.trainer.batch import Layout, TrainBatch
from rlexp.trainer.controller import TrainController
from tests.dist_fit import make_batch, make_vlm_batch
from tests.fakes import UNCHECKED

ONE_CHUNK = 10**9


class WidestVocabBuffer(TorchDispatchMode):
    """The most positions any new tensor [..., vocab] an operator made held; views hold
    nothing, and the head's weight transposed ([hidden, vocab]) is not positions."""

    def __init__(self, head_weight: torch.Tensor):
        super().__init__()
        self.vocab, self.weight_t = head_weight.shape[0], tuple(head_weight.shape[::-1])
        self.positions = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab
                    and not t._is_view() and tuple(t.shape) != self.weight_t):
                self.positions = max(self.positions, t.numel() // self.vocab)
        return out


SGD = partial(torch.optim.SGD, lr=0.1)


def _trainer(path, chunk, optimizer=SGD, **kw):
    torch.manual_seed(0)
    return TrainController(path, temperature=0.7, total_steps=3, logits_chunk_tokens=chunk, entropy_coef=0.01,
                           optimizer=optimizer, ref_kl_every_n_steps=0, sync_check=UNCHECKED, **kw)


def _scored(trainer, batch, forward_watch=None, backward_watch=None):
    """Logprobs, entropies and the gradient of their sum, of the batch as one micro-batch (its
    rows longest first: the input ids in that order come last)."""
    tb = TrainBatch.build(batch, 0, Layout(micro_batch_tokens=ONE_CHUNK))
    micro = tb.micro_batches[0]
    with forward_watch or nullcontext():
        out = trainer.learner.policy(tb, micro)
    logp, entropy = out.logprobs, out.entropy
    with backward_watch or nullcontext():
        (logp.sum() + entropy.sum()).backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return logp.detach(), entropy.detach(), grads, tb.input_ids[micro.rows]  # the rows in output order


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to 1e-5 of the tensor's largest entry, or to 1e-8: fp32's rounding (a matmul of
    fewer rows blocks its sums differently, and how depends on the CPU's kernels: within 1e-6
    on one machine, up to about 3e-6 on another; a key bias gets a gradient of rounding alone,
    up to 1e-9: softmax ignores it), far under any real difference (gradients here are 1e-2 to 10)."""
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max() + 1e-8)


def _assert_same(a, b):
    assert _close(a[0], b[0]) and _close(a[1], b[1])  # logprobs, entropies
    assert sorted(a[2]) == sorted(b[2]) and a[2]
    for name, g in a[2].items():
        assert _close(g, b[2][name]), name


@pytest.mark.parametrize("lora", [0, 4])
def test_chunks_give_the_one_chunk_logprobs_entropies_and_gradients(tiny_model_path, lora):
    batch = make_batch(0)
    whole = _scored(_trainer(tiny_model_path, ONE_CHUNK, lora={"rank": lora}), batch)
    chunked = _scored(_trainer(tiny_model_path, 7, lora={"rank": lora}), batch)
    _assert_same(whole, chunked)
    assert whole[0].shape == (len(batch), whole[3].shape[1] - 1) and (whole[1] > 0).all()


def test_no_vocabulary_buffer_holds_more_than_a_chunk_forward_or_backward(arch_paths):
    path = arch_paths["smollm2"]  # SmolLM2's layout: a tied head, vocabulary 4160 > hidden 128
    batch = make_batch(0)
    trainer = _trainer(path, 16)
    head = trainer.model.get_output_embeddings().weight
    positions = TrainBatch.build(batch, 0, Layout()).input_ids.numel()  # rows x width
    chunked = WidestVocabBuffer(head), WidestVocabBuffer(head)
    whole = WidestVocabBuffer(head), WidestVocabBuffer(head)
    _scored(trainer, batch, *chunked)
    _scored(_trainer(path, ONE_CHUNK), batch, *whole)
    # one chunk in the forward, and in each chunk's backward (its logits recomputed)
    assert [w.positions for w in chunked] == [16, 16]
    assert [w.positions for w in whole] == [positions, positions]  # what one chunk of all holds


def test_the_no_grad_scoring_is_chunked_too(arch_paths):
    batch = make_batch(1)
    trainer = _trainer(arch_paths["qwen2"], 5)
    watch = WidestVocabBuffer(trainer.model.get_output_embeddings().weight)
    with watch:
        chunked = trainer.sample_logprobs(batch)
    whole = _trainer(arch_paths["qwen2"], ONE_CHUNK).sample_logprobs(batch)
    assert watch.positions == 5
    assert all(_close(a, b) for a, b in zip(chunked, whole))


def test_moe_with_routing_replay_chunks_alike(arch_paths):
    from transformers import AutoConfig

    path = arch_paths["qwen3_moe"]
    config = AutoConfig.from_pretrained(path)
    batch = make_batch(0, routing=(config.num_hidden_layers, config.num_experts, config.num_experts_per_tok))
    whole = _scored(_trainer(path, ONE_CHUNK, routing_replay="rollout"), batch)
    chunked = _scored(_trainer(path, 9, routing_replay="rollout"), batch)
    _assert_same(whole, chunked)


def test_vlm_rows_chunk_alike_and_placeholders_stay_masked(vlm_path):
    batch = make_vlm_batch(vlm_path, 0, groups=2, per_group=2)
    trainer = _trainer(vlm_path, 11)
    chunked = _scored(trainer, batch)
    whole = _scored(_trainer(vlm_path, ONE_CHUNK), batch)
    _assert_same(whole, chunked)
    image_token = trainer.model.config.image_token_id
    predicts_image = chunked[3][:, 1:] == image_token
    assert predicts_image.any() and (chunked[0][predicts_image] < -1e30).all()  # never sampled
    assert (chunked[0][~predicts_image] > -1e30).all()


def test_mixed_precision_in_one_process_computes_in_bf16_with_fp32_master_weights(tiny_model_path):
    batch = make_batch(0)
    adam = partial(torch.optim.AdamW, lr=1e-3)
    fp32 = _trainer(tiny_model_path, 16, optimizer=adam)
    mixed = _trainer(tiny_model_path, 16, optimizer=adam, mixed_precision="bfloat16")
    a, b = _scored(fp32, batch), _scored(mixed, batch)
    diff = (a[0] - b[0]).abs().max().item()
    assert 1e-4 < diff < 0.5  # bf16's rounding shows; the same model
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert all(g.dtype == torch.float32 for g in b[2].values())
    mixed.fit(batch, 0)
    state = mixed.learner.optimizer.state[next(iter(mixed.model.parameters()))]
    assert all(v.dtype == torch.float32 for v in state.values() if isinstance(v, torch.Tensor) and v.dim())
