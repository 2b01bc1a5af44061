"""Packer: concatenates variable-length sequences into rows without padding.

A row's `position_ids` restart at 0 for each sequence; transformers then builds a
block-diagonal causal mask from them, so sequences never attend to each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # (1, L)
    position_ids: torch.Tensor  # (1, L)
    members: list[int]  # indices into the original sequence list
    offsets: list[int]  # start of each member within the row


def pack(sequences: list[list[int]], max_tokens_per_row: int) -> list[PackedRow]:
    """First-fit-decreasing bin packing; a sequence longer than a row gets a row alone."""
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
    bins: list[list[int]] = []
    sizes: list[int] = []
    for i in order:
        n = len(sequences[i])
        for b, used in enumerate(sizes):
            if used + n <= max_tokens_per_row:
                bins[b].append(i)
                sizes[b] += n
                break
        else:
            bins.append([i])
            sizes.append(n)
    rows = []
    for members in bins:
        ids: list[int] = []
        pos: list[int] = []
        offsets: list[int] = []
        for i in members:
            offsets.append(len(ids))
            ids.extend(sequences[i])
            pos.extend(range(len(sequences[i])))
        rows.append(PackedRow(torch.tensor([ids]), torch.tensor([pos]), members, offsets))
    return rows
