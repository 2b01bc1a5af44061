"""Where two machines' tiny-model builds first part: every aten op of the warm start, hashed.

    python scripts/op_divergence.py trace here.tsv [--steps 2]   # on each machine (or setting)
    python scripts/op_divergence.py compare amd.tsv intel.tsv      # the first op whose output differs

`trace` builds the default tiny model's random weights (the seed and sizes of conf/model/tiny.yaml)
and runs its first `--steps` warm-start steps (forward, backward, AdamW step) exactly as
`rlexp.models.tiny` does, writing one line per aten op: its index, name, output shapes and the
sha256 of its outputs' bytes. `compare` prints the first line that differs with the lines before
it, and the op counts: the op that rounds differently on the two machines, with its inputs
equal (the lines before it match). Environment settings (MKL_CBWR=..., ONEDNN_MAX_CPU_ISA=...)
apply as they do to a run: set them on the command line."""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Hashes(TorchDispatchMode):
    """Records (op, shapes, sha256) of each dispatched op's tensor outputs."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        digest = hashlib.sha256()
        for t in tensors:
            digest.update(t.detach().contiguous().cpu().numpy().tobytes() if t.numel() else b"")
        shapes = ",".join("x".join(map(str, t.shape)) for t in tensors)
        self.lines.append(f"{len(self.lines)}\t{func}\t{shapes}\t{digest.hexdigest()[:16]}")
        return out


def trace(steps: int) -> list[str]:
    """The default tiny model's first `steps` warm-start steps, one line per aten op."""
    from rlexp.data import arithmetic
    from rlexp.models.tiny import _random_model, _warm_start, build_char_tokenizer

    torch.manual_seed(0)  # conf/config.yaml seed; conf/model/tiny.yaml sizes and warm-start settings
    tokenizer = build_char_tokenizer()
    model = _random_model(tokenizer, hidden_size=128, num_layers=2, num_heads=2)
    train, _ = arithmetic.split(99, "+", 200, 0)
    with _Hashes() as hashes:
        _warm_start(model, tokenizer, train, steps, batch_size=64, lr=0.001, target_accuracy=1.0, seed=0)
    return hashes.lines


def compare(a_path: str, b_path: str) -> int:
    a, b = (open(p).read().splitlines() for p in (a_path, b_path))
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            print(f"the first {i} ops agree; op {i} differs:\n  {a_path}: {x}\n  {b_path}: {y}")
            print("the ops before it:\n  " + "\n  ".join(a[max(0, i - 5):i]))
            return 1
    print(f"identical over {min(len(a), len(b))} ops ({len(a)} and {len(b)} lines)")
    return 0 if len(a) == len(b) else 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("trace")
    t.add_argument("out")
    t.add_argument("--steps", type=int, default=2)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args()
    if args.cmd == "compare":
        sys.exit(compare(args.a, args.b))
    with open(args.out, "w") as f:
        f.write("\n".join(trace(args.steps)) + "\n")


if __name__ == "__main__":
    main()
