"""The trained samples as flat right-padded tensors, built once per fit.

Per-token tensors have L-1 columns: column k is the prediction of token k+1 from tokens
0..k, so `logprobs[:, k]` is log p(tokens[k+1] | tokens[:k+1]). Padding sits after every
real token, and a causal model never lets a real token see a later position, so rows need
no attention mask: the padded positions' outputs are computed and then masked out.

Why padding and not packing: on the default task (256 sequences of <= 29 tokens) one
padded [256, 29] forward+backward took 0.33 s against 0.62 s for the same tokens packed
into 15 rows of 512 run one at a time (attention over a packed row is quadratic in the
row, and rows at batch size 1 use the cores poorly). Sorting by length before cutting
micro-batches keeps the padding small when lengths vary (`pad_frac` reports it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlexp.sample import Sample


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a TokenBatch run in one forward/backward, cut to the longest row's length."""

    rows: torch.Tensor  # [n] long: row indexes into the TokenBatch
    width: int  # padded tokens per row: the longest of these rows
    real: bool = True  # False: a masked-out filler, run only so every rank's FSDP collectives pair up

    @property
    def columns(self) -> slice:
        """The per-token ([N, L-1]) columns these rows predict: width - 1 of them."""
        return slice(0, self.width - 1)


def _padded(rows: list[list], width: int, value, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)


def _routed(samples: list[Sample], width: int) -> torch.Tensor | None:
    """The samples' routing, padded; positions no generation computed (the last token, and
    padding) get experts 0..k-1: their outputs are never used."""
    arrays = [s.trace.routed_experts for s in samples]
    shape = next((a.shape[1:] for a in arrays if a is not None), None)
    if shape is None:
        return None
    out = torch.arange(shape[1], dtype=torch.int16).expand(len(samples), width, *shape).clone()
    for row, a in enumerate(arrays):
        if a is not None:
            n = min(len(a), width)
            out[row, :n] = torch.from_numpy(a[:n].astype("int16"))
    return out


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [N, L] long, right-padded with 0
    loss_mask: torch.Tensor  # [N, L-1] float: 1 where the predicted token is trained
    behav_logprobs: torch.Tensor  # [N, L-1] the rollout's logprob of each predicted token
    staleness: torch.Tensor  # [N, L-1] long: policy versions between rollout and `version`
    # [N, L-1] float: 1 where the behaviour logprob is the model's own (no grammar, penalty or
    # logit bias in its request): what the weight-sync check may compare (TokenTrace.model_sampled)
    model_sampled: torch.Tensor
    lengths: list[int]  # real tokens per row
    # MoE: the engine's experts per position [N, L, layers, k] (rows without: experts 0..k-1)
    routed: torch.Tensor | None = None
    # a vision-language model's: per row its samples' `mm_train_info` (None: no image)
    pixels: list[dict[str, torch.Tensor] | None] | None = None

    @classmethod
    def build(cls, samples: list[Sample], version: int) -> TokenBatch:
        """`version`: the policy being trained. Samples built by hand may carry no versions:
        they count as on-policy."""
        width = max(len(s.tokens) for s in samples)
        stale = [s.token_staleness(version) if s.versions else [0] * len(s.tokens) for s in samples]
        return cls(
            input_ids=_padded([s.tokens for s in samples], width, 0, torch.long),
            loss_mask=_padded([s.loss_mask for s in samples], width, 0, torch.float32)[:, 1:],
            behav_logprobs=_padded([s.logprobs for s in samples], width, 0.0, torch.float32)[:, 1:],
            staleness=_padded(stale, width, 0, torch.long)[:, 1:],
            model_sampled=_padded([s.trace.model_sampled() for s in samples], width, 0, torch.float32)[:, 1:],
            lengths=[len(s.tokens) for s in samples],
            routed=_routed(samples, width),
            pixels=[s.mm_train_info for s in samples] if any(s.mm_train_info for s in samples) else None)

    def __len__(self) -> int:
        return len(self.lengths)

    def model_inputs(self, idx: torch.Tensor, width: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The forward's inputs for rows `idx` cut to `width`: `input_ids`, and with images each
        row's pixel inputs stacked [rows, images, ...] (zeros pad a row with fewer: a model of
        the Idefics3 kind skips all-zero images)."""
        inputs = {"input_ids": self.input_ids[idx, :width].to(device)}
        rows = [self.pixels[i] for i in idx.tolist()] if self.pixels else []
        if any(rows):
            for key in ("pixel_values", "pixel_attention_mask"):
                parts = [r[key] for r in rows if r]
                most, shape, dtype = max(len(p) for p in parts), parts[0].shape[1:], parts[0].dtype
                stacked = torch.zeros(len(rows), most, *shape, dtype=dtype)
                for i, r in enumerate(rows):
                    if r:
                        stacked[i, :len(r[key])] = r[key]
                inputs[key] = stacked.to(device)
        return inputs

    def micro_batches(self, rows: list[int], max_tokens: int) -> list[MicroBatch]:
        """`rows` cut into micro-batches of at most `max_tokens` padded tokens (a single longer
        row gets one alone), longest rows first."""
        order = sorted(rows, key=lambda i: -self.lengths[i])
        pieces: list[list[int]] = []
        for i in order:
            if pieces and (len(pieces[-1]) + 1) * self.lengths[pieces[-1][0]] <= max_tokens:
                pieces[-1].append(i)
            else:
                pieces.append([i])
        return [MicroBatch(torch.tensor(p), self.lengths[p[0]]) for p in pieces]

    def pad_frac(self, forwarded_batches: list[MicroBatch]) -> float:
        """Share of the forwarded positions that are padding."""
        forwarded = sum(len(mb.rows) * mb.width for mb in forwarded_batches)
        real = sum(self.lengths[i] for mb in forwarded_batches for i in mb.rows.tolist())
        return 1.0 - real / forwarded if forwarded else 0.0
