"""A synthetic visual task a tiny vision-language model can learn on a CPU: count the shapes
in a picture. Each picture (PIL, `image_size` square, white) holds 1..`max_shapes` filled
circles and squares of random colours, each in its own quarter of the picture at a random
place there; the question asks how many shapes there are, the reference answer is the number.
Pictures are drawn from a seed per problem, so a split is the same on every machine;
`eval_size` problems are held out."""

from __future__ import annotations

import random

from rlexp.data.sources import Problem, PromptSource

QUESTION = "How many shapes are in the picture? Answer with a number."
COLORS = ("red", "blue", "green", "orange", "purple", "black")


def draw(seed: int, count: int, image_size: int = 64):
    """The picture of problem `seed` with `count` (at most 4) shapes, each in its own quarter
    of the picture at a random place, a random kind and colour."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (image_size, image_size), "white")
    pen = ImageDraw.Draw(img)
    half = image_size // 2
    size = max(4, half * 5 // 8)
    for quarter in rng.sample(range(4), count):
        x = (quarter % 2) * half + rng.randrange(1, half - size)
        y = (quarter // 2) * half + rng.randrange(1, half - size)
        shape = pen.ellipse if rng.random() < 0.5 else pen.rectangle
        shape((x, y, x + size, y + size), fill=rng.choice(COLORS))
    return img


class ShapesSource(PromptSource):
    """`train_size` + `eval_size` problems, counts uniform in 1..max_shapes, drawn from `seed`."""

    def __init__(self, max_shapes: int = 4, image_size: int = 64, train_size: int = 2000,
                 eval_size: int = 200, seed: int = 0, system_prompt: str | None = None):
        if not 1 <= max_shapes <= 4:
            raise ValueError(f"data.source.max_shapes={max_shapes}: 1 .. 4 (one shape per quarter)")
        if image_size < 16:
            raise ValueError(f"data.source.image_size={image_size}: at least 16 pixels")
        rng = random.Random(seed)
        specs = [(rng.randrange(1 << 30), rng.randint(1, max_shapes)) for _ in range(train_size + eval_size)]
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.splits = {name: [Problem(system + [{"role": "user", "content": [
            {"type": "image", "image": draw(s, n, image_size)}, {"type": "text", "text": QUESTION}]}], str(n),
            where=f"shapes: problem seed {s}") for s, n in part]
            for name, part in (("train", specs[eval_size:]), ("eval", specs[:eval_size]))}

    def problems(self, split: str) -> list[Problem]:
        return self.splits[split]
