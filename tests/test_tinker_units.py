"""The Tinker server's pieces without a server (rlexp/tinker/): its losses against Tinker's
documented formulas (values and autograd gradients), the datums' checks, the trainer's rows with
explicit targets, one training model's forward / forward_backward / optim_step on the tiny model,
and the forward's protobuf output (the per-model lane of calls: tests/test_tinker_futures.py)."""

import math
from functools import partial

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from rlexp.algorithms.objective import TokenInputs, TokenSum, Totals
from rlexp.algorithms.unclipped import DRO, CrossEntropy, ImportanceSampling
from rlexp.sample import Sample, Status, TokenTrace
from rlexp.tinker import datums, losses, proto
from rlexp.tinker.errors import BadRequest
from rlexp.tinker.training import AdamStep, TrainingModel
from rlexp.trainer.batch import Layout, TrainBatch
from rlexp.trainer.controller import TrainController
from tests.fakes import UNCHECKED

TOTALS = Totals(tokens=7.0, seqs=3.0)  # TokenSum reads neither: a plain masked sum
E = math.exp
close = partial(assert_close, atol=1e-6, rtol=0)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def token_inputs(logp, old, adv, mask) -> TokenInputs:
    return TokenInputs(t(logp).requires_grad_(), t(old), t(old), t(adv), t(mask))


@pytest.mark.parametrize("loss_fn,mask,per_token,total,grad", [
    # -r A; its gradient -r A (the masked token adds nothing)
    (ImportanceSampling(), [1, 1, 0], [-2 * E(0.5), 1, -3 * E(-0.3)], -2 * E(0.5) + 1, [-2 * E(0.5), 1, 0]),
    # -(A logp - beta/2 (logp - q)^2), beta 0.1; its gradient -A + beta (logp - q)
    (DRO(0.1), [1, 1, 0], [2.0125, -2.0, 1.5045], 0.0125, [-1.95, 1.0, 0.0]),
    (CrossEntropy(), [1, 0.5, 0], [1.0, 2.0, 0.5], 2.0, [-1.0, -0.5, 0.0]),  # -logp, weighted
])
def test_unclipped_losses_values_and_gradients(loss_fn, mask, per_token, total, grad):
    x = token_inputs([-1.0, -2.0, -0.5], [-1.5, -2.0, -0.2], [2.0, -1.0, 3.0], mask)  # log r 0.5, 0, -0.3
    loss, _ = loss_fn(x)
    summed = TokenSum()(loss, x.mask, TOTALS)
    close(loss.detach(), t(per_token))
    close(summed.detach(), t(total))
    close(torch.autograd.grad(summed, x.logp)[0], t(grad))


def test_the_ratio_is_clamped_finite():
    x = token_inputs([50.0, -50.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0])
    loss, _ = ImportanceSampling()(x)
    close(loss.detach(), t([-E(20), -E(-20)]))
    assert torch.autograd.grad(loss.sum(), x.logp)[0].tolist() == [0.0, 0.0]  # past the clamp


@pytest.mark.parametrize("loss_fn,config,field", [
    *[(name, None, "loss_fn") for name in ("stable_reinforce", "custom", "dpo", "")],
    ("ppo", {"clip_ratio": 0.2}, "loss_fn_config.clip_ratio"),
    ("cross_entropy", {"beta": 0.1}, "loss_fn_config.beta"),
    ("ppo", {"clip_low_threshold": "0.8"}, "loss_fn_config.clip_low_threshold"),
    ("ppo", {"clip_high_threshold": True}, "loss_fn_config.clip_high_threshold"),
    ("dro", {"beta": float("nan")}, "loss_fn_config.beta"),
    ("dro", {"beta": -0.1}, "loss_fn_config.beta"),
    ("ppo", {"clip_low_threshold": 1.2, "clip_high_threshold": 0.8}, "loss_fn_config"),
    ("cispo", {"clip_low_threshold": 1.1}, "loss_fn_config"),  # above 1 (high stays 1.2)
    ("gspo", {"clip_high_threshold": 0.99}, "loss_fn_config"),
])
def test_spec_refuses_what_it_does_not_serve_naming_the_field(loss_fn, config, field):
    with pytest.raises(BadRequest) as e:
        losses.spec(loss_fn, config)
    assert e.value.field == field and e.value.status == 400
    assert field != "loss_fn" or f"loss_fn {loss_fn!r}" in str(e.value)


# two rows of four positions; ratios on both sides of [0.8, 1.2], advantages of both signs
P = [[-1.0, -2.0, -0.5, -1.5], [-0.3, -2.5, -1.2, -0.7]]
Q = (t(P) - t([[1.1, 1.5, 0.5, 0.7], [1.3, 0.9, 0.6, 1.25]]).log()).tolist()
A = [[1.0, 1.0, 1.0, -1.0], [-1.0, 2.0, -0.5, 0.5]]
M = [[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]]  # the weights; gspo's sequence_ratio_mask (A not 0 outside)
CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def clipped(r, a, lo=0.8, hi=1.2):
    return -torch.min(r * a, r.clamp(lo, hi) * a).sum()


def seq_mean(x, m):
    return torch.stack([row[mask != 0].mean() for row, mask in zip(x, m)])


TINKER = {  # Tinker's documented losses (https://tinker-docs.thinkingmachines.ai/losses), written out
    "cross_entropy": lambda p, q, a, m: -(m * p).sum(),
    "importance_sampling": lambda p, q, a, m: -(torch.exp(p - q) * a).sum(),
    "ppo": lambda p, q, a, m: clipped(torch.exp(p - q), a),
    "cispo": lambda p, q, a, m: -(torch.exp(p - q).clamp(0.8, 1.2).detach() * a * p).sum(),
    "dro": lambda p, q, a, m: -(a * p - 0.05 / 2 * (p - q) ** 2).sum(),
    "gspo": lambda p, q, a, m: clipped(torch.exp(seq_mean(p.detach() - q, m)[:, None] + p - p.detach()), a),
}


@pytest.mark.parametrize("loss_fn", list(TINKER))
def test_each_loss_fn_is_tinkers_formula_value_and_gradient(loss_fn):
    config = CLIP if "clip_low_threshold" in losses.LOSSES[loss_fn].config else None
    objective = losses.objective(loss_fn, losses.spec(loss_fn, config)[1])
    x = token_inputs(P, Q, A, M if loss_fn in ("cross_entropy", "gspo") else [[1.0] * 4] * 2)  # datums.rows's
    got = objective.aggregate(objective.token_loss(x, None, None)[0], x.mask, TOTALS)
    got_grad = torch.autograd.grad(got, x.logp)[0]
    p = t(P).requires_grad_()
    want = TINKER[loss_fn](p, t(Q), t(A), t(M))
    close(got.detach(), want.detach())
    close(got_grad, torch.autograd.grad(want, p)[0])
    assert (got_grad != 0).any() and (loss_fn not in ("ppo", "gspo") or (got_grad == 0).any())  # a clip binds


VOCAB, MAX_TOKENS = 16, 8


def put(tensor, values, dtype: str) -> None:
    a = np.asarray(values, dtype)
    tensor.Clear()
    tensor.dense, tensor.dtype = a.tobytes(), proto.DTYPE_INT64 if dtype == "<i8" else proto.DTYPE_FLOAT32
    tensor.shape.extend(a.shape)


def datum(request, chunks, **inputs):
    """A Datum of `chunks` (token ids) and loss_fn_inputs (target_tokens int64, the rest float32)."""
    d = request.data.add()
    for j, tokens in enumerate(chunks):
        chunk(d, j, tokens)
    for key, values in inputs.items():
        put(d.loss_fn_inputs[key], values, "<i8" if key == "target_tokens" else "<f4")
    return d


def rows_of(loss_fn: str, *data: dict) -> datums.Rows:
    request = proto.ForwardBackwardRequest()
    for d in data:
        datum(request, **d)
    return datums.rows(request.data, losses.LOSSES[loss_fn], VOCAB, MAX_TOKENS)


SFT = dict(chunks=[[5, 6], [7]], target_tokens=[6, 7, 9], weights=[0.0, 1.0, 0.5])
RL = dict(chunks=[[3, 4]], target_tokens=[4, 15], logprobs=[-0.5, -1.25], advantages=[1.0, -2.0])


def test_rows_of_good_datums():
    rows = rows_of("cross_entropy", SFT, dict(chunks=[[1, 2]], target_tokens=[2, 0], weights=[1.0, 1.0]))
    assert rows == datums.Rows([[5, 6, 7], [1, 2]], [[6, 7, 9], [2, 0]], [[0.0, 1.0, 0.5], [1.0, 1.0]],
                               [[0.0] * 3, [0.0] * 2], [[0.0] * 3, [0.0] * 2]) and rows.tokens == 5
    for loss_fn in ("importance_sampling", "ppo", "cispo", "dro", "gspo"):  # mask: every position
        assert rows_of(loss_fn, RL) == datums.Rows([[3, 4]], [[4, 15]], [[1.0, 1.0]], [[-0.5, -1.25]],
                                                   [[1.0, -2.0]])
    assert rows_of("gspo", RL | {"sequence_ratio_mask": [0.0, 1.0]}).mask == [[0.0, 1.0]]


def chunk(d, j: int, tokens) -> None:
    """model_input[j] (past the end: a new chunk) holds `tokens` (bytes, or int32 ids)."""
    raw = tokens if isinstance(tokens, bytes) else np.asarray(tokens, "<i4").tobytes()
    (d.model_input[j] if j < len(d.model_input) else d.model_input.add()).encoded_text.tokens = raw


MALFORMED = {  # a fault of data[1] -> the field named
    "lengths": ("loss_fn_inputs.weights", lambda d, i: put(i["weights"], [1.0, 1.0], "<f4")),
    "input token": ("model_input", lambda d, i: chunk(d, 0, [5, 16, 7])),
    "negative token": ("model_input", lambda d, i: chunk(d, 0, [5, -1, 7])),
    "target token": ("loss_fn_inputs.target_tokens", lambda d, i: put(i["target_tokens"], [6, 7, 16], "<i8")),
    "missing": ("loss_fn_inputs.weights", lambda d, i: i.pop("weights")),
    "not taken": ("loss_fn_inputs.advantages", lambda d, i: put(i["advantages"], [1.0, 1.0, 1.0], "<f4")),
    "inf": ("loss_fn_inputs.weights", lambda d, i: put(i["weights"], [1.0, np.inf, 1.0], "<f4")),
    "float targets": ("loss_fn_inputs.target_tokens.dtype",
                      lambda d, i: put(i["target_tokens"], [6.0, 7.0, 9.0], "<f4")),
    "int32 weights": ("loss_fn_inputs.weights.dtype", lambda d, i: setattr(i["weights"], "dtype", 3)),
    "2-D": ("loss_fn_inputs.weights", lambda d, i: put(i["weights"], [[1.0], [1.0], [1.0]], "<f4")),
    "short bytes": ("loss_fn_inputs.weights", lambda d, i: setattr(i["weights"], "dense", b"\0" * 8)),
    "odd bytes": ("model_input[1].tokens", lambda d, i: chunk(d, 1, b"\x05\x00\x00")),
    "image": ("model_input[2]", lambda d, i: d.model_input.add().image.SetInParent()),
    "too long": ("model_input", lambda d, i: chunk(d, 1, [1] * 7)),  # 9 tokens > 8
    **{f"ppo: no {key}": (f"loss_fn_inputs.{key}", partial(lambda k, d, i: i.pop(k), key))
       for key in ("target_tokens", "logprobs", "advantages")},
    "ppo: nan": ("loss_fn_inputs.advantages", lambda d, i: put(i["advantages"], [np.nan, 1.0], "<f4")),
    "ppo: weights": ("loss_fn_inputs.weights", lambda d, i: put(i["weights"], [1.0, 1.0], "<f4")),
}


@pytest.mark.parametrize("case", [*MALFORMED, "empty data"])
def test_malformed_datums_are_refused_naming_the_field(case):
    request, field = proto.ForwardBackwardRequest(), "data"
    loss_fn, good = ("ppo", RL) if case.startswith("ppo") else ("cross_entropy", SFT)
    if case != "empty data":
        datum(request, **good)  # data[0] is good
        d = datum(request, **good)
        MALFORMED[case][1](d, d.loss_fn_inputs)
        field = f"data[1].{MALFORMED[case][0]}"
    with pytest.raises(BadRequest) as e:
        datums.rows(request.data, losses.LOSSES[loss_fn], VOCAB, MAX_TOKENS)
    assert e.value.field == field and e.value.status == 400 and field.split(".")[0] in str(e.value)


def training_model(path) -> TrainingModel:  # the head in chunks of 3 positions
    trainer = TrainController(path, temperature=1.0, optimizer=partial(torch.optim.AdamW, lr=1e-3),
                              total_steps=1, lr_schedule="constant", ref_kl_every_n_steps=0,
                              logits_chunk_tokens=3, sync_check=UNCHECKED)
    return TrainingModel("m", trainer, "tiny", 0, 128, max_tokens=64, micro_batch_tokens=8192)


def direct_logprobs(model, inputs: list[int], targets: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at each input position, at that position's target."""
    logits = model(torch.tensor([inputs])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


INPUTS = [[5, 9, 17, 40, 2], [7, 3, 88]]
TARGETS = [[9, 17, 3, 2, 100], [3, 1, 1]]  # row 0 position 2 predicts 3, not the next input 40


def test_explicit_targets_score_the_models_logprobs_of_them(tiny_model_path):
    trainer = training_model(tiny_model_path).trainer
    batch = TrainBatch.of_tokens(INPUTS, TARGETS, [[1.0] * 5, [1.0] * 3], [[0.0] * 5, [0.0] * 3], Layout())
    got = trainer.learner.policy.logprobs(batch).cpu()
    with torch.no_grad():
        for i, (inputs, targets) in enumerate(zip(INPUTS, TARGETS)):
            close(got[i, :len(inputs)], direct_logprobs(trainer.model, inputs, targets), atol=1e-5)
        next_token = direct_logprobs(trainer.model, INPUTS[0], INPUTS[0][1:] + [0])
    assert abs(float(got[0, 2] - next_token[2])) > 1e-3  # the target scored, not the next input
    seqs = ([5, 9, 17, 40, 2, 11], [7, 3, 88, 1])  # targets the next inputs: the samples' path exactly
    old = TrainBatch.build([Sample(0, [], "", status=Status.COMPLETED, trace=TokenTrace(
        s, [0, 0] + [1] * (len(s) - 2), [0.0] * len(s), [0] * len(s))) for s in seqs], 0, Layout())
    cut = [len(s) - 1 for s in seqs]
    new = TrainBatch.of_tokens([s[:-1] for s in seqs], [s[1:] for s in seqs], [[1.0] * n for n in cut],
                               [[0.0] * n for n in cut], Layout())
    assert torch.equal(old.input_ids, new.input_ids) and old.lengths == new.lengths
    assert torch.equal(trainer.learner.policy.logprobs(old), trainer.learner.policy.logprobs(new))


def sft(inputs, targets, weights) -> datums.Rows:
    return datums.Rows(inputs, targets, weights, *[[[0.0] * len(i) for i in inputs]] * 2)


ONE = sft([INPUTS[0]], [TARGETS[0]], [[0.0, 1.0, 0.5, 1.0, 1.0]])
TWO = sft([INPUTS[1]], [TARGETS[1]], [[1.0, 1.0, 2.0]])
BOTH = sft(INPUTS[::-1], TARGETS[::-1], TWO.mask + ONE.mask)  # shorter first: rows run longest first


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_forward_reports_the_weighted_loss_and_keeps_no_gradient(tiny_model_path):
    tm = training_model(tiny_model_path)
    model = tm.trainer.model
    out = tm.forward(BOTH, "cross_entropy", {}, backward=False)
    assert not grads(model) and tm.pending_tokens == 0 and out.tokens == 8
    assert [len(lp) for lp in out.logprobs] == [3, 5]
    loss = -sum(float((np.asarray(w) * lp).sum()) for w, lp in zip(BOTH.mask, out.logprobs))
    assert out.metrics["loss:sum"] == pytest.approx(loss, abs=1e-5)
    with torch.no_grad():
        close(torch.from_numpy(out.logprobs[0]), direct_logprobs(model, INPUTS[1], TARGETS[1]), atol=1e-5)
    backward = tm.forward(BOTH, "cross_entropy", {}, backward=True)
    got = grads(model)
    assert backward.metrics["loss:sum"] == pytest.approx(loss, abs=1e-5) and got and tm.pending_tokens == 8
    tm.forward(ONE, "cross_entropy", {}, backward=False)  # a forward between: the sums stay
    assert all(torch.equal(g, model.get_parameter(n).grad) for n, g in got.items())
    model.zero_grad(set_to_none=True)  # loss:sum's gradient, computed directly
    sum(-(torch.tensor(w) * direct_logprobs(model, i, j)).sum()
        for i, j, w in zip(BOTH.inputs, BOTH.targets, BOTH.mask)).backward()
    for name, g in grads(model).items():
        assert (got[name] - g).abs().max() <= 1e-5 * g.abs().max() + 1e-8, name


def test_gspo_sums_every_position_through_the_trainer(tiny_model_path):
    tm = training_model(tiny_model_path)
    rows = datums.Rows(INPUTS, TARGETS, [[1.0, 1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0]],  # sequence_ratio_mask
                       [[-2.0, -3.0, -1.0, -4.0, -2.5], [-3.0, -1.5, -2.0]],
                       [[1.0, -1.0, 2.0, 0.5, -0.5], [-1.0, 1.0, 3.0]])  # advantages, not 0 outside it
    out = tm.forward(rows, "gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, backward=True)
    want = 0.0
    for lp, q, a, m in zip(out.logprobs, rows.logprobs, rows.advantages, rows.mask):
        lp, q, a = t(lp.tolist()), t(q), t(a)
        want += float(clipped(torch.exp(seq_mean([lp - q], [t(m)])), a, 0.9, 1.1))
    assert out.metrics["loss:sum"] == pytest.approx(want, abs=1e-4) and grads(tm.trainer.model)


def test_gradients_add_up_over_calls_until_the_step(tiny_model_path):
    # eps large: Adam's first step is lr g / (|g| + eps), continuous in g (with a tiny eps it is
    # lr sign(g), and a gradient of rounding alone, as a key bias's, would step either way)
    adam = AdamStep(learning_rate=0.01, eps=1.0, grad_clip_norm=0)
    apart, together = training_model(tiny_model_path), training_model(tiny_model_path)
    before = {n: p.detach().clone() for n, p in apart.trainer.model.named_parameters()}
    apart.forward(ONE, "cross_entropy", {}, backward=True)
    apart.forward(TWO, "cross_entropy", {}, backward=True)
    together.forward(BOTH, "cross_entropy", {}, backward=True)
    g = grads(together.trainer.model)
    a, b = apart.optim_step(adam), together.optim_step(adam)
    assert a == pytest.approx(b) and b["tokens:sum"] == 8
    assert b["grad_norm:mean"] > 1.0  # the trainer's max_grad_norm (1.0) would have clipped it
    moved = 0.0
    for (name, p), q in zip(together.trainer.model.named_parameters(), apart.trainer.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), name
        # grad_clip_norm 0: no clipping, the unclipped gradient's AdamW step (no weight decay)
        step = adam.learning_rate * g[name] / (g[name].abs() + adam.eps) if name in g else 0.0
        assert torch.allclose(p, before[name] - step, atol=1e-6, rtol=0), name
        moved = max(moved, float((p.detach() - before[name]).abs().max()))
    assert moved > 1e-3 and apart.steps == together.steps == 1 and together.pending_tokens == 0


def test_forward_output_decodes_to_the_per_datum_arrays_and_metrics():
    arrays = [np.asarray([-0.5, -1.25, -3.0], "<f4"), np.asarray([], "<f4"), np.asarray([-2.0], "<f4")]
    out = proto.ForwardBackwardOutput()
    out.ParseFromString(proto.forward_output(arrays, {"loss:sum": 4.75}))
    assert out.loss_fn_output_type == "ArrayRecord" and dict(out.metrics) == {"loss:sum": 4.75}
    (record,) = out.loss_fn_outputs
    assert record.num_datums == 3 and list(record.fields) == ["logprobs"]
    field = record.fields["logprobs"]
    assert field.dtype == proto.DTYPE_FLOAT32 and not field.trailing_shape
    offsets, data = np.frombuffer(field.offsets, "<i8").tolist(), np.frombuffer(field.data, "<f4")
    assert offsets == [0, 12, 12, 16]  # bytes, as the SDK slices them
    per_datum = [data[i // 4:j // 4].tolist() for i, j in zip(offsets, offsets[1:])]
    assert per_datum == [a.tolist() for a in arrays]
