"""The checks a run makes before its heavy imports: they import nothing heavy, they say the
same as the full checks after the imports, and the light tokenizer counts like transformers'."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import get_object

from rlexp.chat.render import render_prompt
from rlexp.config import _signature, validate
from rlexp.errors import ConfigError
from rlexp.preflight import LightTokenizer
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
