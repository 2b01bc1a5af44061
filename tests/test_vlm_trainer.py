"""The trainer with a vision-language model (rlexp/models/vlm.py, SmolVLM's layout) on image
batches, no vLLM: `trainer.freeze_vision` (the vision encoder neither trains nor is pushed),
LoRA on the language model only (merged weights named and shaped as the base model's), and
FSDP2 over 2 CPU ranks (gloo, torchrun) updating like one process.

    .venv/bin/pytest tests/test_vlm_trainer.py -s     # prints the figures ([vlm trainer] lines)
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

from rlexp.trainer.controller import TrainController
from tests.dist_fit import make_vlm_batch
from tests.fakes import UNCHECKED
from tests.test_trainer_ranks import _fit, _max_diff

VISION = "model.vision_model."  # Idefics3's vision encoder, as the engine names its tensors
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the YAML's


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    from rlexp.models.vlm import build_vlm_model

    return build_vlm_model(str(tmp_path_factory.mktemp("vlm")), seed=0, warm_start_steps=0)


@pytest.fixture(scope="module")
def base(vlm_path) -> dict[str, torch.Tensor]:
    """The built model's state dict: the names and shapes vLLM loads."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vlm_path, dtype=torch.float32).state_dict()


def _trainer(path, **kw) -> TrainController:
    torch.manual_seed(0)
    return TrainController(path, temperature=1.0, optimizer=partial(torch.optim.SGD, lr=0.5), total_steps=2,
                           ref_kl_every_n_steps=0, sync_check=UNCHECKED, **kw)


def _state(trainer) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in trainer.model.state_dict().items()}


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_vision_keeps_the_vision_encoder_and_leaves_it_out_of_the_sync(vlm_path, base, tmp_path,
                                                                                freeze):
    trainer = _trainer(vlm_path, freeze_vision=freeze)
    vision = {n for n in base if n.startswith(VISION)}
    assert vision and all(n.startswith(VISION) for n in base if "vision" in n)
    optimized = {id(p) for group in trainer.learner.optimizer.param_groups for p in group["params"]}
    for n, p in trainer.model.named_parameters():
        assert p.requires_grad == (id(p) in optimized) == (not (freeze and n.startswith(VISION))), n
    before = _state(trainer)
    metrics = trainer.fit(make_vlm_batch(vlm_path, 0), 0)
    after = _state(trainer)
    assert metrics["train/skipped_step"] == 0.0
    moved = {n for n in after if not torch.equal(after[n], before[n])}
    assert any(n.startswith("model.text_model.") for n in moved) and any("connector" in n for n in moved)
    assert bool(moved & vision) != freeze  # frozen: every vision tensor bitwise unchanged
    pushed = dict(trainer.weights())
    assert set(pushed) == (set(base) - vision if freeze else set(base))
    assert all(pushed[n].shape == base[n].shape for n in pushed)
    # a checkpoint keeps the whole model, the frozen encoder too, and loads back
    trainer.save(tmp_path)
    again = _trainer(vlm_path, freeze_vision=freeze)
    again.load(tmp_path)
    assert _max_diff(_state(again), after) == 0


def test_freeze_vision_needs_a_vision_language_model(tmp_path):
    """Refused from the config alone, before any weights load (the directory has none)."""
    from transformers import AutoConfig

    from rlexp.trainer.models import vision_encoder

    AutoConfig.for_model("llama", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, vocab_size=100).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="trainer.freeze_vision=true needs a vision-language model"):
        _trainer(str(tmp_path), freeze_vision=True)
    with pytest.raises(ValueError, match="trainer.freeze_vision: Linear has no vision encoder"):
        vision_encoder(torch.nn.Linear(2, 2))


def test_a_sharded_vlm_refuses_a_batch_mixing_rows_with_and_without_images():
    """Unguarded, 2 ranks, one's micro-batch with an image and the other's without, die in
    gloo ("Received data size doesn't match expected size. Is there a distributed collective
    mismatch"): only the first runs the vision encoder's all-gathers."""
    from rlexp.trainer.batch import check_sharded_images

    pixels = {"pixel_values": torch.zeros(1, 3, 8, 8)}
    for rows, world in (([pixels, pixels], 2), ([None, None], 2), (None, 2), ([pixels, None], 1)):
        check_sharded_images(rows, world)
    with pytest.raises(ValueError, match="over 2 ranks needs an image in every trained row or in none"):
        check_sharded_images([pixels, None, pixels], 2)


def test_lora_adapts_only_the_language_model_and_publishes_the_base_models_tensors(vlm_path, base):
    """The vision tower's attention has q_proj/v_proj too: no adapters there (nor with the
    YAML's default target list). One fit step moves only the adapters; the merged weights have
    exactly the base model's names and shapes, differ from it only in the adapted weights, and
    equal peft's own merge."""
    trainer = _trainer(vlm_path, lora={"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj"]})
    adapted = sorted({n.split(".lora_")[0].removeprefix("base_model.model.")
                      for n, _ in trainer.model.named_parameters() if ".lora_" in n})
    assert adapted == [f"model.text_model.layers.{i}.self_attn.{m}" for i in range(2)
                       for m in ("q_proj", "v_proj")]
    assert all(".lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    before = _state(trainer)
    trainer.fit(make_vlm_batch(vlm_path, 0), 0)
    after = _state(trainer)
    moved = {n for n in after if not torch.equal(after[n], before[n])}
    assert moved and all(".lora_B." in n or ".lora_A." in n for n in moved)
    merged = dict(trainer.weights())
    assert list(merged) == list(base) and all(merged[n].shape == base[n].shape for n in base)
    changed = {n for n in base if not torch.equal(merged[n], base[n])}
    assert changed == {f"{m}.weight" for m in adapted}
    reference = copy.deepcopy(trainer.model).merge_and_unload().state_dict()
    assert _max_diff(merged, reference) < 1e-6
    wide = _trainer(vlm_path, freeze_vision=True,
                    lora={"rank": 4, "alpha": 16, "target_modules": DEFAULT_TARGETS})
    names = {n.split(".lora_")[0] for n, _ in wide.model.named_parameters() if ".lora_" in n}
    assert len(names) == 2 * len(DEFAULT_TARGETS) and all(".text_model." in n for n in names)
    assert set(dict(wide.weights())) == {n for n in base if not n.startswith(VISION)}


@pytest.mark.parametrize("freeze", [False, True])
def test_two_ranks_fit_image_batches_like_one_process(vlm_path, tmp_path, freeze):
    """FSDP2 (the vision attention and decoder layers their own units) on 2 gloo ranks with
    40-token micro-batches vs 1 process with one micro-batch: the same weights after 2 fits of
    image batches (1 or 2 pictures per prompt, some padded), minibatches_per_step 1 and 2.
    train/grad_norm is compared at 1e-4: the fp32 norm of the tied embedding's gradient on CPU
    is itself ~5e-5 off its float64 value, and the shards' norms round differently."""
    args = ["--vlm", "--fits", "2", *(["--freeze-vision"] if freeze else [])]
    one = _fit(vlm_path, tmp_path / "one.pt", *args, "--micro-batch-tokens", "100000")
    two = _fit(vlm_path, tmp_path / "two.pt", *args, ranks=2)
    for mb in (1, 2):
        w1, w2 = one[mb]["weights"], two[mb]["weights"]
        assert any(n.startswith(VISION) for n in w1) != freeze
        diff = _max_diff(w1, w2)
        print(f"\n[vlm trainer] freeze_vision={freeze}, minibatches={mb}: max |w(1 process) - w(2 ranks)| "
              f"= {diff:.2e}")
        assert diff < 1e-5
        for m1, m2 in zip(one[mb]["metrics"], two[mb]["metrics"]):
            assert m2["train/loss"] == pytest.approx(m1["train/loss"], abs=1e-6)
            assert m2["train/grad_norm"] == pytest.approx(m1["train/grad_norm"], rel=1e-4)
