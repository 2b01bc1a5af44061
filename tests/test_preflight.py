"""The checks a run makes before its heavy imports: they import nothing heavy, they say the
same as the full checks after the imports, and the light tokenizer counts like transformers'."""

import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import get_object

from rlexp.chat.render import encode, render_prompt
from rlexp.config import _signature, validate
from rlexp.data.file_sources import JsonlSource
from rlexp.errors import ConfigError
from rlexp.messages import split_images
from rlexp.preflight import ImageTokens, LightTokenizer, preflight
from rlexp.signatures import static_signature
from tests.test_config import BAD_OVERRIDES, CONF, _compose

TARGETS = sorted({line.split("_target_:")[1].strip() for path in CONF.rglob("*.yaml")
                  for line in path.read_text().splitlines() if "_target_: rlexp." in line})
HEAVY = ("torch", "transformers", "vllm", "mlflow")


@pytest.mark.parametrize("target", TARGETS)
def test_static_signature_matches_the_imported_one(target):
    static = static_signature(target)
    if static is None:  # the source cannot tell (e.g. a subclass of a third-party class)
        return
    params, hints = static
    real_params, real_hints = _signature(get_object(target))
    assert list(params) == [p for p in real_params if p != "self"]
    assert {k: v for k, v in hints.items()} == {k: real_hints[k] for k in hints}
    assert all(params[p].default is real_params[p].default is params[p].empty
               or (params[p].default is not params[p].empty and real_params[p].default is not params[p].empty)
               for p in params)


def test_static_signature_reports_what_does_not_exist():
    with pytest.raises(ModuleNotFoundError, match="rlexp.agents.nope"):
        static_signature("rlexp.agents.nope.Agent")
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        static_signature("rlexp.judges.math_exact.Nope")
    assert static_signature("torch.optim.AdamW") is None  # not rlexp's: left to the full check


def test_static_signature_reads_an_init_inherited_within_its_module():
    """JsonlSource and ParquetSource share `_FileSource.__init__`: the static check still
    refuses a key that is not an argument before any file is read."""
    for target in ("rlexp.data.file_sources.JsonlSource", "rlexp.data.file_sources.ParquetSource"):
        params, _ = static_signature(target)
        assert list(params)[:2] == ["train_path", "eval_path"] and "image_key" in params


@pytest.mark.parametrize("override, message", BAD_OVERRIDES)
def test_static_check_never_disagrees_with_the_full_one(override, message):
    """It finds the same error, or leaves it to the full check; it never finds another."""
    try:
        validate(_compose(override.split()), static=True)
    except ConfigError as e:
        assert re.search(message, str(e))


SCRIPT = """
import sys
from hydra import compose, initialize_config_dir
from rlexp.errors import ConfigError
from rlexp.preflight import preflight
with initialize_config_dir(config_dir={conf!r}, version_base="1.3"):
    cfg = compose("config", overrides=sys.argv[1:])
try:
    preflight(cfg)
    error = None
except ConfigError as e:
    error = str(e)
print({{"error": error, "heavy": [m for m in {heavy!r} if m in sys.modules]}})
"""


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "bad.jsonl").write_text('{"question": "1+1=", "answer": "#### 2"}\nnot json\n')
    rows = [{"question": "1+1=" + " pad" * (400 if i == 7 else 0), "answer": "#### 2"} for i in range(300)]
    (d / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "bad.parquet").write_bytes(b"PAR1 not really parquet")
    (d / "hf").mkdir()
    (d / "hf" / "dataset_dict.json").write_text('{"splits": ["train", "test"]}')
    _picture(0).save(d / "a.png")
    (d / "images.jsonl").write_text("".join(json.dumps({"question": "How many?", "answer": str(i),
                                                        "image": "a.png"}) + "\n" for i in range(3)))
    return d


@pytest.mark.parametrize("overrides, message", [
    (["data=jsonl", "data.source.train_path={d}/bad.jsonl"], "bad.jsonl:2: not valid JSON"),
    (["data=parquet", "data.source.train_path={d}/bad.parquet"], "bad.parquet: not a readable Parquet file"),
    (["data=hf_disk", "data.source.train_path={d}/hf", "data.source.train_split=training"],
     "hf: no split 'training' (has ['train', 'test'])"),
    (["+trainer.no_such_knob=1"],
     "trainer.no_such_knob is not an argument of rlexp.trainer.controller.TrainController"),
    (["agent._target_=rlexp.agents.nope.Agent"], "cannot import 'rlexp.agents.nope.Agent'"),
    (["rollout.max_response_tokens=lots"], "rollout.max_response_tokens must be an integer"),
    (["model=local", "model.path={model}", "data=jsonl", "data.source.train_path={d}/long.jsonl",
      "data.prompts_per_step=4"], "1 prompt(s) of the train split do not fit"),
    (["model=local", "model.path={model}", "data=jsonl_images", "data.source.train_path={d}/images.jsonl",
      "data.source.eval_size=1", "data.prompts_per_step=1"],
     "data.source (rlexp.data.file_sources.JsonlSource, train_path={d}/images.jsonl) has images, but the "
     "model at {model} is not a vision-language model (its config.json has no vision_config); use one, "
     "e.g. model=vlm"),
])
def test_bad_input_is_reported_before_any_heavy_import(overrides, message, bad_files, tiny_model_path):
    """In a fresh process, as `python -m rlexp.run` starts: the error, and none of torch,
    transformers, vLLM or MLflow imported by then."""
    args = [o.format(d=bad_files, model=tiny_model_path) for o in overrides]
    code = SCRIPT.format(conf=str(CONF), heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                         cwd=Path(CONF).parent)
    assert out.returncode == 0, out.stderr[-2000:]
    result = eval(out.stdout.strip().splitlines()[-1])
    message = message.format(d=bad_files, model=tiny_model_path)
    assert result["error"] is not None and message in result["error"], result
    assert result["heavy"] == []


def test_light_tokenizer_counts_like_transformers(tiny_model_path, tokenizer):
    light = LightTokenizer.load(tiny_model_path)
    assert light is not None
    for messages in ([{"role": "user", "content": "12+34="}],
                     [{"role": "system", "content": "Answer with a number.\n"},
                      {"role": "user", "content": "7*8="}],
                     [{"role": "user", "content": "héllo ✓ <|im_end|> tabs\tand\nnewlines"}]):
        assert render_prompt(light, messages) == render_prompt(tokenizer, messages)
    assert LightTokenizer.load("/nonexistent") is None


# ---- prompts with images: a vision-language model's directory and its image tokens -------------


def _picture(seed: int, size=(64, 64)):
    from PIL import Image

    return Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3))


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory) -> str:
    from rlexp.models.vlm import build_vlm_model

    return build_vlm_model(str(tmp_path_factory.mktemp("vlm")), seed=0, warm_start_steps=0)


@pytest.fixture(scope="module")
def agent_prompts(vlm_path):
    """The single-turn agent's rendering of a prompt with images: its token ids are the truth."""
    from transformers import AutoTokenizer

    from rlexp.chat.images import ImagePrompts

    return ImagePrompts(AutoTokenizer.from_pretrained(vlm_path))


def _image_prompt(question: str, images) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": im} for im in images]
             + [{"type": "text", "text": question}]}]


def _placeholder_tokens(agent_prompts, messages) -> int:
    """Tokens of the prompt's text with each image as its one placeholder token, unexpanded."""
    processor = agent_prompts.processor
    text = processor.apply_chat_template(split_images(messages)[0], add_generation_prompt=True)
    return len(encode(processor.tokenizer, text))


def test_image_tokens_count_as_the_agent_renders(agent_prompts):
    """Per image size, and summed, or (the fallback) each prompt through the processor: both are
    the length of the agent's token ids, for images of several sizes, one to three a prompt."""
    prompts = [_image_prompt("How many?", [_picture(0)]),
               _image_prompt("Which is larger, the left or the right one?", [_picture(1, (100, 30)),
                                                                              _picture(2, (20, 200))]),
               _image_prompt("", [_picture(3, (64, 64)), _picture(4, (7, 9)), _picture(5, (300, 200))])]
    truth = [len(agent_prompts(m)[1]) for m in prompts]
    summed, full = ImageTokens(agent_prompts.processor), ImageTokens(agent_prompts.processor)
    full._summed = False
    assert [summed.length(m, "p")[0] for m in prompts] == truth
    assert summed._summed is True
    assert [full.length(m, "p")[0] for m in prompts] == truth
    n_text = _placeholder_tokens(agent_prompts, prompts[0]) - 1
    assert truth[0] > n_text + 1
    assert summed.length(prompts[0], "p") == (truth[0], f"p: {n_text} text + {truth[0] - n_text} image "
                                                        f"tokens for 1 image(s)")


def _vlm_cfg(vlm_path, data: Path, *overrides: str):
    return _compose(["model=local", f"model.path={vlm_path}", "data=jsonl_images",
                     f"data.source.train_path={data}/train.jsonl", f"data.source.eval_path={data}/eval.jsonl",
                     "data.prompts_per_step=1", "rollout.max_response_tokens=8", *overrides])


@pytest.fixture(scope="module")
def image_rows(tmp_path_factory):
    """train.jsonl: line 2 holds eight pictures, the others one; eval.jsonl: one row of one."""
    d = tmp_path_factory.mktemp("image_rows")
    for i in range(8):
        _picture(i).save(d / f"{i}.png")
    rows = [{"question": "How many?", "answer": "1", "image": "0.png"},
            {"question": "How many?", "answer": "8", "image": [f"{i}.png" for i in range(8)]},
            {"question": "How many?", "answer": "1", "image": "1.png"}]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return d


def test_image_tokens_count_towards_the_context(vlm_path, image_rows, agent_prompts):
    """A prompt whose text fits but whose images' tokens do not fails in preflight, named by its
    row and counts; the same data fits once the context holds the agent's whole prompt."""
    long = JsonlSource(str(image_rows / "train.jsonl"), eval_path=str(image_rows / "eval.jsonl"),
                       image_key="image", answer_pattern=None).problems("train")[1]
    n_long = len(agent_prompts(long.messages)[1])
    placeholders = _placeholder_tokens(agent_prompts, long.messages)
    n_text = placeholders - 8
    assert n_long > placeholders + 8 * 4  # each image is several tokens, its placeholder one
    room = n_long - 1  # the text with one token per image fits, the images' tokens do not
    with pytest.raises(ConfigError) as err:
        preflight(_vlm_cfg(vlm_path, image_rows, f"rollout.max_model_len={room + 8}"))
    where = f"{image_rows}/train.jsonl:2: {n_text} text + {n_long - n_text} image tokens for 8 image(s)"
    assert str(err.value) == (
        f"1 prompt(s) of the train split do not fit in rollout.max_model_len={room + 8} with "
        f"rollout.max_response_tokens=8 (first: {where}); the longest ({where}) has {n_long} tokens. "
        f"Raise max_model_len or drop those rows")
    inputs = preflight(_vlm_cfg(vlm_path, image_rows, f"rollout.max_model_len={n_long + 8}"))
    assert inputs.lengths_checked


def test_images_need_a_model_with_an_image_processor(vlm_path, image_rows, tmp_path):
    """A directory with a vision_config but no image processor fails before any processor is
    loaded, naming the model and the data."""
    model = tmp_path / "no_image_processor"
    shutil.copytree(vlm_path, model)
    config = json.loads((model / "processor_config.json").read_text())
    del config["image_processor"]
    (model / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as err:
        preflight(_vlm_cfg(model, image_rows, "rollout.max_model_len=4096"))
    assert str(err.value) == (
        f"data.source (rlexp.data.file_sources.JsonlSource, train_path={image_rows}/train.jsonl) has images, "
        f"but the model at {model} is not a vision-language model (it has no image processor: no "
        f"preprocessor_config.json, no image_processor in processor_config.json); use one, e.g. model=vlm")
