"""The trained rows of one fit as one frozen record, built once from the samples, and how
they are cut: minibatches (one optimizer step each), dealt to the ranks in micro-batches
(one forward/backward each).

Per-token tensors have L-1 columns: column k is the prediction of token k+1 from tokens
0..k, so `logprobs[:, k]` is log p(tokens[k+1] | tokens[:k+1]). Padding sits after every
real token, and a causal model never lets a real token see a later position, so rows need
no attention mask: the padded positions' outputs are computed and then masked out.

Why padding and not packing: on the default task (256 sequences of <= 29 tokens) one
padded [256, 29] forward+backward took 0.33 s against 0.62 s for the same tokens packed
into 15 rows of 512 run one at a time (attention over a packed row is quadratic in the
row, and rows at batch size 1 use the cores poorly). Sorting by length before cutting
micro-batches keeps the padding small when lengths vary (`pad_frac` reports it).

Distributed: every rank builds the same record from the whole batch; each minibatch's rows
are dealt to the ranks token-balanced, and ranks run equally many micro-batches (FSDP's
collectives pair up): a rank with fewer pads with a masked-out filler."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from rlexp.algorithms.objective import Totals
from rlexp.sample import Sample, Status
from rlexp.trainer import distributed


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a TrainBatch run in one forward/backward, cut to the longest row's length."""

    rows: torch.Tensor  # [n] long: row indexes into the TrainBatch
    width: int  # padded tokens per row: the longest of these rows
    real: bool = True  # False: a masked-out filler, run only so every rank's FSDP collectives pair up

    @property
    def columns(self) -> slice:
        """The per-token ([N, L-1]) columns these rows predict: width - 1 of them."""
        return slice(0, self.width - 1)

    def take(self, per_token: torch.Tensor) -> torch.Tensor:
        """These rows' entries of a per-token tensor [N, L-1], on the tensor's device."""
        return per_token[self.rows.to(per_token.device), self.columns]


@dataclass(frozen=True)
class Minibatch:
    """The rows of one optimizer step."""

    rows: tuple[int, ...]  # every rank's: the aggregation's totals count them all
    micro_batches: tuple[MicroBatch, ...]  # this rank's, fillers included
    everyone: tuple[MicroBatch, ...]  # every rank's real micro-batches (for train/pad_frac)
    totals: Totals


@dataclass(frozen=True)
class Layout:
    """How a batch is cut (trainer.minibatches_per_step, trainer.micro_batch_tokens) and which
    rank of how many reads it."""

    minibatches: int = 1
    micro_batch_tokens: int = 8192
    rank: int = 0
    world: int = 1


@dataclass(frozen=True)
class Images:
    """A vision-language model's pixel inputs: per row its sample's `mm_train_info` (None: no image)."""

    rows: tuple[dict[str, torch.Tensor] | None, ...]

    def inputs(self, idx: torch.Tensor, device: torch.device) -> dict[str, torch.Tensor]:
        """Rows `idx`' pixel inputs stacked [rows, images, ...] (zeros pad a row with fewer: a
        model of the Idefics3 kind skips all-zero images); empty when none of them has one."""
        rows = [self.rows[i] for i in idx.tolist()]
        if not any(rows):
            return {}
        out = {}
        for key in ("pixel_values", "pixel_attention_mask"):
            parts = [r[key] for r in rows if r]
            most, shape, dtype = max(len(p) for p in parts), parts[0].shape[1:], parts[0].dtype
            stacked = torch.zeros(len(rows), most, *shape, dtype=dtype)
            for i, r in enumerate(rows):
                if r:
                    stacked[i, :len(r[key])] = r[key]
            out[key] = stacked.to(device)
        return out


@dataclass(frozen=True)
class RoutedExperts:
    """An MoE's routing as the engine computed it: the experts of each position at each MoE
    layer, [N, L, layers, k] (rows the engine gave none, and positions no generation computed:
    experts 0..k-1, whose outputs are never used)."""

    ids: torch.Tensor

    def rows(self, idx: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
        return self.ids[idx, :width].to(device)


@dataclass(frozen=True)
class TeacherTokens:
    """On-policy distillation: the teacher's scores of the rows' predicted tokens ([N, L-1],
    the samples' TeacherScores shifted like the other per-token tensors)."""

    logprobs: torch.Tensor  # the teacher's logprob of each predicted token (0 where not scored)
    scored: torch.Tensor  # float: 1 where the teacher scored it
    top_ids: torch.Tensor | None  # [N, L-1, k] long: its likeliest ids at each position (teacher.top_k)
    top_logprobs: torch.Tensor | None  # [N, L-1, k]

    @classmethod
    def build(cls, samples: list[Sample], width: int) -> TeacherTokens | None:
        scores = [s.teacher for s in samples]
        if not any(scores):
            return None
        logprobs = [t.logprobs if t else [0.0] * len(s.tokens) for s, t in zip(samples, scores)]
        scored = [t.scored if t else [0] * len(s.tokens) for s, t in zip(samples, scores)]
        k = next((len(t.top_ids[1]) for t in scores if t and t.top_ids and len(t.top_ids) > 1), 0)
        top_ids, top_logprobs = None, None
        if k:
            top_ids = _padded([t.top_ids if t and t.top_ids else [] for t in scores], width, [0] * k,
                              torch.long)[:, 1:]
            top_logprobs = _padded([t.top_logprobs if t and t.top_logprobs else [] for t in scores], width,
                                   [0.0] * k, torch.float32)[:, 1:]
        return cls(_padded(logprobs, width, 0.0, torch.float32)[:, 1:],
                   _padded(scored, width, 0, torch.float32)[:, 1:], top_ids, top_logprobs)


@dataclass(frozen=True)
class TrainBatch:
    """The trained rows, [N, L] or [N, L-1] per token, right-padded."""

    version: int  # the policy being trained
    produced: int  # samples in the batch as produced, failed ones included
    input_ids: torch.Tensor  # [N, L] long, padded with 0
    loss_mask: torch.Tensor  # [N, L-1] float: 1 where the predicted token is trained
    rollout_logprobs: torch.Tensor  # [N, L-1] the engine's logprob of each predicted token
    staleness: torch.Tensor  # [N, L-1] long: policy versions between rollout and `version`
    # [N, L-1] float: 1 where the rollout logprob is the model's own (no grammar, penalty or
    # logit bias in its request): what the weight-sync check may compare (TokenTrace.model_sampled)
    model_sampled: torch.Tensor
    lengths: tuple[int, ...]  # real tokens per row
    rewards: torch.Tensor  # [N] the judge's
    groups: tuple[Hashable, ...]  # [N] each row's prompt group
    minibatches: tuple[Minibatch, ...]
    micro_batches: tuple[MicroBatch, ...]  # this rank's over all its rows (the forwards before the update)
    images: Images | None  # a vision-language model's
    routed: RoutedExperts | None  # an MoE's, when the engine recorded them (rollout.routing_capture)
    teacher: TeacherTokens | None  # on-policy distillation's teacher scores (teacher=local | openai)
    targets: torch.Tensor | None = None  # [N, L-1] long: what each position predicts (None: the next token)

    @classmethod
    def build(cls, samples: list[Sample], version: int, layout: Layout,
              produced: int | None = None) -> TrainBatch:
        """`samples` as rows (`trained` picks a fit's). Samples built by hand may carry no
        versions: they count as on-policy."""
        width = max(len(s.tokens) for s in samples)
        stale = [s.token_staleness(version) if s.versions else [0] * len(s.tokens) for s in samples]
        lengths = tuple(len(s.tokens) for s in samples)
        loss_mask = _padded([s.loss_mask for s in samples], width, 0, torch.float32)[:, 1:]
        minibatches, mine = _plan(lengths, loss_mask, layout)
        images = [s.mm_train_info for s in samples]
        check_sharded_images(images, layout.world)
        return cls(
            version=version, produced=len(samples) if produced is None else produced,
            input_ids=_padded([s.tokens for s in samples], width, 0, torch.long), loss_mask=loss_mask,
            rollout_logprobs=_padded([s.logprobs for s in samples], width, 0.0, torch.float32)[:, 1:],
            staleness=_padded(stale, width, 0, torch.long)[:, 1:],
            model_sampled=_padded([s.trace.model_sampled() for s in samples], width, 0, torch.float32)[:, 1:],
            lengths=lengths, rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
            groups=tuple(s.group_id for s in samples), minibatches=minibatches, micro_batches=mine,
            images=Images(tuple(images)) if any(images) else None,
            routed=_routed(samples, width), teacher=TeacherTokens.build(samples, width))

    @classmethod
    def of_tokens(cls, inputs: list[list[int]], targets: list[list[int]], weights: list[list[float]],
                  logprobs: list[list[float]], layout: Layout, version: int = 0) -> TrainBatch:
        """Rows given position by position, as the Tinker API's datums are: row i reads
        `inputs[i]` and at each of its positions predicts `targets[i]` (any token, not only the
        next input); `weights[i]` (float) is each position's mask, `logprobs[i]` the sampler's.
        On-policy, one group per row; no images, routing or teacher."""
        width = max(len(i) for i in inputs) + 1  # one column per input position
        lengths = tuple(len(i) + 1 for i in inputs)
        loss_mask = _padded([list(w) for w in weights], width - 1, 0.0, torch.float32)
        minibatches, mine = _plan(lengths, loss_mask, layout)
        zeros = torch.zeros(len(inputs), width - 1)
        return cls(
            version=version, produced=len(inputs),
            input_ids=_padded([i + t[-1:] for i, t in zip(inputs, targets)], width, 0, torch.long),
            loss_mask=loss_mask, rollout_logprobs=_padded([list(p) for p in logprobs], width - 1, 0.0,
                                                          torch.float32),
            staleness=zeros.long(), model_sampled=zeros, lengths=lengths,
            rewards=torch.zeros(len(inputs)), groups=tuple(range(len(inputs))), minibatches=minibatches,
            micro_batches=mine, images=None, routed=None, teacher=None,
            targets=_padded([list(t) for t in targets], width - 1, 0, torch.long))

    def __len__(self) -> int:
        return len(self.lengths)

    def pad_frac(self) -> float:
        """Share of the positions the minibatches' forwards ran (every rank's) that are padding."""
        forwarded_batches = [mb for m in self.minibatches for mb in m.everyone]
        forwarded = sum(len(mb.rows) * mb.width for mb in forwarded_batches)
        real = sum(self.lengths[i] for mb in forwarded_batches for i in mb.rows.tolist())
        return 1.0 - real / forwarded if forwarded else 0.0


def trained(samples: list[Sample]) -> list[Sample]:
    """The samples a fit trains: completed, with a response. A failed sample is no row and
    shifts no baseline."""
    return [s for s in samples if s.status == Status.COMPLETED and s.response_length]


def check_sharded_images(pixels: list | None, world: int) -> None:
    """FSDP2 gathers the vision encoder's shards only in a forward that runs it, and a model of
    the Idefics3 kind runs it only for a micro-batch with an image: ranks whose micro-batches
    differ there pair up the wrong collectives (gloo fails "collective mismatch", NCCL would
    hang). Until image-less rows get a dummy image (verl feeds one and adds 0 x its features),
    a sharded vision-language model trains batches whose rows all have images, or none does."""
    if world > 1 and pixels and any(pixels) and not all(pixels):
        raise ValueError(f"a vision-language model sharded over {world} ranks needs an image in every "
                         f"trained row or in none: {sum(not p for p in pixels)} of {len(pixels)} have none")


def micro_batches(lengths: tuple[int, ...], rows: list[int], max_tokens: int) -> list[MicroBatch]:
    """`rows` cut into micro-batches of at most `max_tokens` padded tokens (a single longer
    row gets one alone), longest rows first."""
    order = sorted(rows, key=lambda i: -lengths[i])
    pieces: list[list[int]] = []
    for i in order:
        if pieces and (len(pieces[-1]) + 1) * lengths[pieces[-1][0]] <= max_tokens:
            pieces[-1].append(i)
        else:
            pieces.append([i])
    return [MicroBatch(torch.tensor(p), lengths[p[0]]) for p in pieces]


def _plan(lengths: tuple[int, ...], loss_mask: torch.Tensor,
          layout: Layout) -> tuple[tuple[Minibatch, ...], tuple[MicroBatch, ...]]:
    """The rows cut into `layout.minibatches` (strided), each dealt to the ranks token-balanced
    and cut into micro-batches; and this rank's micro-batches over all its rows."""
    n = min(layout.minibatches, len(lengths))
    shares = [distributed.balanced_split(list(range(m, len(lengths), n)), list(lengths), layout.world)
              for m in range(n)]
    planned = []
    for share in shares:
        rows = sum(share, [])
        mask = loss_mask[rows]
        totals = Totals(tokens=float(mask.sum()), seqs=float((mask.sum(-1) > 0).sum()))
        planned.append(Minibatch(tuple(rows), *_deal(lengths, share, layout), totals))
    rows_of_rank = [sorted(i for share in shares for i in share[r]) for r in range(layout.world)]
    return tuple(planned), _deal(lengths, rows_of_rank, layout)[0]


def _deal(lengths: tuple[int, ...], shares: list[list[int]],
          layout: Layout) -> tuple[tuple[MicroBatch, ...], tuple[MicroBatch, ...]]:
    """This rank's micro-batches of its share, padded with fillers to as many as the busiest
    rank has, and every rank's real ones."""
    per_rank = [micro_batches(lengths, share, layout.micro_batch_tokens) for share in shares]
    mine = list(per_rank[layout.rank])
    filler = MicroBatch(torch.tensor([0]), 2, real=False)  # a masked-out 2-token row: collectives only
    mine += [filler] * (max(map(len, per_rank)) - len(mine))
    return tuple(mine), tuple(mb for r in per_rank for mb in r)


def _padded(rows: list[list], width: int, value, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)


def _routed(samples: list[Sample], width: int) -> RoutedExperts | None:
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
    return RoutedExperts(out)
