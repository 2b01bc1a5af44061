"""Rows with images (image_key) in JSONL, Parquet and `datasets` save_to_disk directories: the
pixels saved are the pixels read, in every form a row may give them (a path relative to its
file, bytes, lists, `datasets.Image()` dicts and features); a bad image fails with one line
naming the file, row and key."""

import random

import datasets
import pytest

from rlexp.data.file_sources import HFDiskSource, JsonlSource, ParquetSource
from tests.data_source_helpers import _jsonl, _parquet

PLAIN = {"answer_pattern": None}  # the answers here are the whole field, not GSM8K's "#### n"

# ---- rows with images (image_key) -------------------------------------------------------------


def _picture(seed: int, size=(24, 16), mode="RGB"):
    """Random pixels, so that two different images never compare equal."""
    from PIL import Image

    rng = random.Random(seed)
    return Image.frombytes(mode, size, rng.randbytes(size[0] * size[1] * len(mode)))


def _png(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _parts(problem):
    """(the images, as RGB pixel bytes, then the text) of a problem's user message."""
    content = problem.messages[-1]["content"]
    assert [p["type"] for p in content] == ["image"] * (len(content) - 1) + ["text"], content
    assert all(p["image"].mode == "RGB" for p in content[:-1])
    return [(p["image"].size, p["image"].tobytes()) for p in content[:-1]], content[-1]["text"]


def _rgb(*images):
    return [(im.size, im.convert("RGB").tobytes()) for im in images]


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Three pictures saved as PNG (one grayscale, one with alpha), and the data directory."""
    d = tmp_path_factory.mktemp("pictures")
    (d / "img" / "sub").mkdir(parents=True)
    images = [_picture(0), _picture(1, (9, 13), "L"), _picture(2, (16, 16), "RGBA")]
    for name, im in zip(("img/a.png", "img/sub/b.png", "c.png"), images):
        im.save(d / name)
    return d, images


def test_jsonl_image_paths_are_relative_to_the_file_and_load_the_saved_pixels(pictures, monkeypatch):
    d, (a, b, c) = pictures
    rows = [{"question": "one", "answer": "1", "image": "img/a.png"},
            {"question": "two", "answer": "2", "image": ["img/sub/b.png", str(d / "c.png")]},
            {"question": "none", "answer": "0", "image": []}]
    train = _jsonl(d / "train.jsonl", rows)
    monkeypatch.chdir(d / "img")  # relative to the JSONL file, not to the working directory
    src = JsonlSource(train, eval_path=train, image_key="image", system_prompt="Count.", **PLAIN)
    one, two, none = src.problems("eval")
    assert one.messages[0] == {"role": "system", "content": "Count."}
    assert _parts(one) == (_rgb(a), "one")
    assert _parts(two) == (_rgb(b, c), "two")
    assert _parts(none) == ([], "none")
    assert two.where == f"{d}/train.jsonl:2"
    text_rows = JsonlSource(train, eval_path=train, **PLAIN).problems("eval")  # no image_key
    assert text_rows[0].messages[-1] == {"role": "user", "content": "one"}  # text rows, as before


def _all(src):
    return [_parts(p) for p in sorted(src.problems("train") + src.problems("eval"), key=lambda p: p.where)]


def test_parquet_images_as_bytes_lists_and_image_dicts(pictures):
    """A binary column; a list column (two images a row); `datasets.Image()`'s dicts, by bytes or
    by a path relative to the Parquet file (what `Dataset.to_parquet` writes for files)."""
    d, (a, b, c) = pictures
    rows = [{"question": f"q{i}", "answer": "1", "image": _png(im)} for i, im in enumerate((a, b))]
    def parquet(name, rows, key="image"):
        return ParquetSource(_parquet(d / name, rows), image_key=key, eval_size=1, **PLAIN)

    assert _all(parquet("bytes.parquet", rows)) == [(_rgb(a), "q0"), (_rgb(b), "q1")]
    pairs = [{"question": f"q{i}", "answer": "2", "images": [_png(c), _png(a)]} for i in range(2)]
    assert _all(parquet("two.parquet", pairs, "images")) == [(_rgb(c, a), "q0"), (_rgb(c, a), "q1")]
    dicts = [{"question": "q0", "answer": "1", "image": {"bytes": _png(b), "path": "not/read.png"}},
             {"question": "q1", "answer": "2", "image": {"bytes": None, "path": "img/a.png"}}]
    assert _all(parquet("dicts.parquet", dicts)) == [(_rgb(b), "q0"), (_rgb(a), "q1")]


def test_save_to_disk_image_features_read_as_datasets_reads_them(pictures):
    d, (a, b, c) = pictures
    img, seq = datasets.Image(), datasets.Sequence(datasets.Image())
    one = datasets.Dataset.from_dict({"question": ["q0", "q1"], "answer": ["0", "1"],
                                      "image": [str(d / "img/a.png"), str(d / "c.png")]})
    two = datasets.Dataset.from_dict({"question": ["q2"], "answer": ["2"],
                                      "image": [[str(d / "img/sub/b.png"), str(d / "img/a.png")]]})
    datasets.DatasetDict({"train": one.cast_column("image", img),
                          "test": two.cast_column("image", seq)}).save_to_disk(str(d / "hf"))
    src = HFDiskSource(str(d / "hf"), eval_split="test", image_key="image", **PLAIN)
    assert [_parts(p) for p in src.problems("train")] == [(_rgb(a), "q0"), (_rgb(c), "q1")]
    assert [_parts(p) for p in src.problems("eval")] == [(_rgb(b, a), "q2")]
    loaded = datasets.load_from_disk(str(d / "hf"))  # the real reader: same pixels
    assert _parts(src.problems("eval")[0])[0] == _rgb(*loaded["test"][0]["image"])
    assert [_parts(p)[0] for p in src.problems("train")] == [_rgb(r["image"]) for r in loaded["train"]]


@pytest.fixture(scope="module")
def bad_images(pictures):
    """Files with one bad image value in their second row (row 1 / line 2)."""
    d, (a, *_) = pictures
    png = _png(_picture(5, (64, 64)))
    (d / "truncated.png").write_bytes(png[:len(png) // 2])
    (d / "text.png").write_text("not an image")
    good = {"question": "q", "answer": "1", "image": "img/a.png"}
    bad = {"missing": "img/nope.png", "number": 7, "truncated": ["img/a.png", "truncated.png"],
           "text": "text.png", "url": "https://example.com/a.png", "dir": "img"}
    for name, value in bad.items():
        _jsonl(d / f"bad_{name}.jsonl", [good, {**good, "image": value}])
    _parquet(d / "bad_bytes.parquet", [{**good, "image": _png(a)}, {**good, "image": b"\x89PNG junk"}])
    _parquet(d / "bad_dict.parquet", [{**good, "image": {"bytes": None, "path": None}}] * 2)
    _parquet(d / "no_column.parquet", [{"question": "q", "answer": "1"}] * 2)
    ds = datasets.Dataset.from_dict({"question": ["q", "q"], "answer": ["1", "1"],
                                     "image": [str(d / "img/a.png"), None]})
    ds = ds.cast_column("image", datasets.Image())
    ds.save_to_disk(str(d / "hf_null"))
    return d


BAD_IMAGES = {  # the source, its file, the error's text; {d}: the data directory
    "missing file": (JsonlSource, "bad_missing.jsonl",
                     "{d}/bad_missing.jsonl:2: key 'image': image file not found: {d}/img/nope.png"),
    "not an image value": (JsonlSource, "bad_number.jsonl",
                           "{d}/bad_number.jsonl:2: key 'image': expected an image path, image bytes or a "
                           "{{'bytes', 'path'}} dict, or a list of them; got int"),
    "truncated file": (JsonlSource, "bad_truncated.jsonl",
                       "{d}/bad_truncated.jsonl:2: key 'image' item 1: PIL cannot decode image file "
                       "{d}/truncated.png (image file is truncated"),
    "not an image file": (JsonlSource, "bad_text.jsonl",
                          "{d}/bad_text.jsonl:2: key 'image': PIL cannot decode image file {d}/text.png "
                          "(not an image format PIL knows; 12 bytes)"),
    "remote url": (JsonlSource, "bad_url.jsonl",
                   "{d}/bad_url.jsonl:2: key 'image': https://example.com/a.png: not a local path"),
    "a directory": (JsonlSource, "bad_dir.jsonl",
                    "{d}/bad_dir.jsonl:2: key 'image': a directory, not an image file: {d}/img"),
    "corrupt bytes": (ParquetSource, "bad_bytes.parquet",
                      "{d}/bad_bytes.parquet: row 1: key 'image': PIL cannot decode the image bytes"),
    "empty image dict": (ParquetSource, "bad_dict.parquet",
                         "{d}/bad_dict.parquet: row 0: key 'image': an image dict with neither 'bytes' nor "
                         "'path' set"),
    "no image column": (ParquetSource, "no_column.parquet",
                        "{d}/no_column.parquet: missing column 'image' (has ['answer', 'question']); "
                        "see data.source.image_key"),
    "null image": (HFDiskSource, "hf_null", "{d}/hf_null: row 1: key 'image': expected an image path"),
}


@pytest.mark.parametrize("name", list(BAD_IMAGES))
def test_bad_images_name_the_file_row_and_key(bad_images, name):
    cls, file, message = BAD_IMAGES[name]
    with pytest.raises(ValueError) as err:
        cls(str(bad_images / file), image_key="image", eval_size=1, **PLAIN)
    assert message.format(d=bad_images) in str(err.value)
    assert "\n" not in str(err.value)
