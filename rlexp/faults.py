"""Which samples the fault injectors fail (rlexp/agents/faulty.py, rlexp/judges/faulty.py):
a draw fixed by the seed, the sample's own seed and who draws it, so a rerun (or a resumed
run) fails the same samples."""

from __future__ import annotations

import random

from rlexp.sample import Sample


def fault_draw(seed: int, sample: Sample, salt: str) -> float:
    """A number in [0, 1) fixed by the seed, the sample's own seed and who draws it."""
    return random.Random(f"{seed}:{salt}:{sample.metadata.get('seed', sample.uid)}").random()
