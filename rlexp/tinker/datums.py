"""The Tinker API's datums, checked and turned into rows of rlexp's batch record.

A datum (protobuf, rlexp/tinker/proto.py) is `model_input` (chunks of token ids, N in all) and
`loss_fn_inputs`, tensors of N values each: position i of the input predicts
`target_tokens[i]`. Every check names the datum and the field at fault
(`data[3].loss_fn_inputs.advantages`) and runs before any forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from rlexp.tinker.errors import BadRequest
from rlexp.tinker.losses import LossSpec
from rlexp.tinker.proto import DTYPE_FLOAT32, DTYPE_INT64

INT_KEYS = {"target_tokens"}


@dataclass(frozen=True)
class Rows:
    """The datums of one call, checked: per datum its input tokens and, per position, its
    target, mask (cross_entropy's weights; 1 for the RL losses, whose sums run over every
    position), the sampler's logprobs and the advantages (0 where the loss has none)."""

    inputs: list[list[int]]
    targets: list[list[int]]
    mask: list[list[float]]
    logprobs: list[list[float]]
    advantages: list[list[float]]

    @property
    def tokens(self) -> int:
        return sum(len(i) for i in self.inputs)


def model_input_tokens(chunks: Any, where: str) -> list[int]:
    """The token ids of a datum's `model_input` chunks (encoded_text: little-endian int32)."""
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise BadRequest(f"{where}[{j}]: chunk kind {kind!r} is not served (text models: encoded_text)",
                             f"{where}[{j}]")
        raw = chunk.encoded_text.tokens
        if len(raw) % 4:
            raise BadRequest(f"{where}[{j}].tokens: {len(raw)} bytes is not a whole number of int32 ids",
                             f"{where}[{j}].tokens")
        tokens += np.frombuffer(raw, "<i4").tolist()
    return tokens


def check_tokens(tokens: list[int], vocab_size: int, where: str) -> None:
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"{where}: token id {bad} is out of the vocabulary (0..{vocab_size - 1})", where)


def tensor(value: Any, n: int, where: str, integer: bool) -> list:
    """A 1-D dense tensor of `n` finite values (float32, or int64 where `integer`)."""
    if value.WhichOneof("encoding") != "dense" or len(value.shape) != 1:
        raise BadRequest(f"{where}: only 1-D dense tensors are served (shape [N]), got shape "
                         f"{list(value.shape)} ({value.WhichOneof('encoding') or 'no data'})", where)
    dtype = {DTYPE_FLOAT32: "<f4", DTYPE_INT64: "<i8"}.get(value.dtype)
    if dtype is None or (dtype == "<f4") == integer:
        want = "int64" if integer else "float32"
        raise BadRequest(f"{where}: dtype must be {want}", f"{where}.dtype")
    raw = value.dense
    if len(raw) % np.dtype(dtype).itemsize or len(raw) // np.dtype(dtype).itemsize != value.shape[0]:
        raise BadRequest(f"{where}: {len(raw)} bytes do not hold shape {list(value.shape)}", where)
    if value.shape[0] != n:
        raise BadRequest(f"{where} has {value.shape[0]} values; model_input has {n} tokens", where)
    data = np.frombuffer(raw, dtype)
    if not integer and not np.isfinite(data).all():
        raise BadRequest(f"{where} holds a value that is not finite (NaN or inf)", where)
    return data.tolist()


def rows(data: Any, loss: LossSpec, vocab_size: int, max_tokens: int) -> Rows:
    """The datums (protobuf `Datum`s) of a forward / forward_backward call, checked against the
    loss's inputs."""
    if not data:
        raise BadRequest("data must hold at least one datum", "data")
    out = Rows([], [], [], [], [])
    allowed = {"target_tokens", *loss.inputs, *loss.optional}
    for i, datum in enumerate(data):
        at = f"data[{i}]"
        tokens = model_input_tokens(datum.model_input, f"{at}.model_input")
        if not 1 <= len(tokens) <= max_tokens:
            raise BadRequest(f"{at}.model_input has {len(tokens)} tokens; the model takes 1 to {max_tokens}",
                             f"{at}.model_input")
        check_tokens(tokens, vocab_size, f"{at}.model_input")
        inputs = datum.loss_fn_inputs
        for key in inputs:
            if key not in allowed:
                raise BadRequest(f"{at}.loss_fn_inputs.{key} is not an input of this loss (it takes: "
                                 f"{', '.join(sorted(allowed))})", f"{at}.loss_fn_inputs.{key}")
        for key in ("target_tokens", *loss.inputs):
            if key not in inputs:
                raise BadRequest(f"{at}.loss_fn_inputs.{key} is missing", f"{at}.loss_fn_inputs.{key}")
        keys = sorted(inputs, key=lambda k: k != "target_tokens")  # the targets' faults first
        got = {k: tensor(inputs[k], len(tokens), f"{at}.loss_fn_inputs.{k}", k in INT_KEYS) for k in keys}
        check_tokens(got["target_tokens"], vocab_size, f"{at}.loss_fn_inputs.target_tokens")
        _add(out, tokens, got)
    return out


def _add(out: Rows, tokens: list[int], got: dict[str, list]) -> None:
    n = len(tokens)
    out.inputs.append(tokens)
    out.targets.append(got["target_tokens"])
    mask = got.get("weights") or got.get("sequence_ratio_mask") or [1.0] * n
    out.mask.append([float(v) for v in mask])
    out.logprobs.append([float(v) for v in got.get("logprobs", [0.0] * n)])
    out.advantages.append([float(v) for v in got.get("advantages", [0.0] * n)])
