"""The images a data row names (the file sources' `image_key`), loaded with PIL when the row is
read. A row's value is one image or a list of them; an image is

- a path string, relative to the data file's directory (a `save_to_disk` dataset: the directory
  named in the config) or absolute;
- encoded bytes (PNG, JPEG, ...), as a Parquet or Arrow binary column holds them;
- the `datasets` Image feature's dict `{"bytes": ..., "path": ...}` (what `datasets.Image()`
  stores): its bytes where set, else its path.

Each image is decoded in full (`Image.load`), so a missing, truncated or corrupt image fails
here with one line naming the row and the key, not later in the engine; it is converted to RGB
(an alpha channel is dropped). PIL is imported only where a source has an `image_key`."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

EXPECTED = "an image path, image bytes or a {'bytes', 'path'} dict, or a list of them"


def load_images(value: Any, base: Path, where: str) -> list[Any]:
    """The images (PIL, RGB) of one row's value. `base`: the directory a relative path is in;
    `where`: the row and key, for errors."""
    if isinstance(value, list):
        return [_load(v, base, f"{where} item {i}") for i, v in enumerate(value)]
    return [_load(value, base, where)]


def _load(value: Any, base: Path, where: str):
    if isinstance(value, dict) and set(value) <= {"bytes", "path"}:
        if value.get("bytes") is not None:
            value = value["bytes"]
        elif value.get("path") is not None:
            value = value["path"]
        else:
            raise ValueError(f"{where}: an image dict with neither 'bytes' nor 'path' set")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _decode(bytes(value), "the image bytes", where)
    if isinstance(value, str) and value:
        return _decode(_read(value, base, where), f"image file {_resolve(value, base)}", where)
    got = "an empty path" if value == "" else "null" if value is None else type(value).__name__
    raise ValueError(f"{where}: expected {EXPECTED}; got {got}")


def _resolve(name: str, base: Path) -> str:
    return os.path.abspath(Path(name) if Path(name).is_absolute() else base / name)


def _read(name: str, base: Path, where: str) -> bytes:
    if "://" in name:
        raise ValueError(f"{where}: {name}: not a local path (images are read from local files only)")
    path = _resolve(name, base)
    if not os.path.isfile(path):
        what = "a directory, not an image file" if os.path.isdir(path) else "image file not found"
        raise ValueError(f"{where}: {what}: {path}")
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{where}: cannot read image file {path} ({e.strerror or e})") from None


def _decode(data: bytes, what: str, where: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError:
        detail = f"not an image format PIL knows; {len(data)} bytes"
    except Exception as e:  # whatever else PIL raises on bytes it cannot decode (truncated, corrupt)
        detail = " ".join(str(e).split()) or type(e).__name__
    raise ValueError(f"{where}: PIL cannot decode {what} ({detail})")


QUARTERS = ("top-left", "top-right", "bottom-left", "bottom-right")


def zoom(image, quarter: str):
    """The `quarter` (one of QUARTERS) of `image`, resized to the image's size."""
    from PIL import Image

    w, h = image.size
    col, row = QUARTERS.index(quarter) % 2, QUARTERS.index(quarter) // 2
    box = (col * w // 2, row * h // 2, (col + 1) * w // 2, (row + 1) * h // 2)
    return image.crop(box).resize((w, h), Image.Resampling.BICUBIC)


def zoom_caption(quarter: str, k: int) -> str:
    """The text beside a zoomed picture (the zoom tool's, and the VLM warm-start's)."""
    return f"The {quarter} quarter of picture {k}."
