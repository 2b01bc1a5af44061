"""Hub ids for models and data (rlexp/data/hub.py, model=local, data=hub), with no network.

Every test points HF_HOME and HF_HUB_CACHE at a temporary directory, sets HF_HUB_OFFLINE=1 and
lays out a hub cache there itself, as `hf download` leaves it: `<cache>/models--org--name/`
(`datasets--org--name/`) with each file's bytes once under `blobs/`, `snapshots/<commit>/` of
symlinks to them, and `refs/<branch or tag>` holding a commit.

huggingface_hub reads HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE (and TRANSFORMERS_OFFLINE, HF_ENDPOINT,
...) once, when it is imported, into `huggingface_hub.constants`; `datasets` does the same for its
own cache and offline flag (`datasets.config`). So whatever resolves an id or loads a dataset runs
in a fresh Python process, which inherits the test's environment; only local paths, which never
reach huggingface_hub, are checked in this process."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from rlexp.checkpoint import RUN_CONFIG
from rlexp.data.hub import resolve
from rlexp.data.sources import HubSource
from rlexp.errors import ConfigError
from rlexp.models.local import local_model

ROOT = Path(__file__).resolve().parents[1]
MODEL_ID, DATA_ID = "tiny-org/tiny-chat", "tiny-org/arith"
PATTERN = r"####\s*(.+)$"
HEAVY = ("torch", "transformers", "vllm", "mlflow", "datasets")
ROWS = {"train": [{"question": f"{a}+{b}=", "answer": f"{a}+{b} is #### {a + b}"}
                  for a in range(8) for b in range(8)],
        "test": [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"}
                 for a in range(8, 12) for b in range(5)]}
SMALL = {"train": ROWS["train"][:3], "test": ROWS["test"][:2]}  # the dataset's second config


def _commit(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()


def lay_out(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes], commit: str,
            refs: tuple[str, ...] = ("main",)) -> Path:
    """One snapshot of a repo in a hub cache, as huggingface_hub writes it; its directory."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, named by HF_HOME and HF_HUB_CACHE, offline (inherited by subprocesses)."""
    home = tmp_path / "hf-home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_CACHE", raising=False)  # under HF_HOME
    return home / "hub"


def _model_files(tiny_model_path: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in Path(tiny_model_path).iterdir() if p.is_file()}


def _parquet(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


CARD = """---
configs:
- config_name: main
  default: true
  data_files:
  - split: train
    path: main/train-*.parquet
  - split: test
    path: main/test-*.parquet
- config_name: small
  data_files:
  - split: train
    path: small/train.parquet
  - split: test
    path: small/test.parquet
---
Sums of small numbers, GSM8K-style answers.
"""


def _dataset_files() -> dict[str, bytes]:
    """A hub dataset as they are laid out: a card whose YAML names the configs and their files
    (`datasets` picks one format for all of a dataset's configs: Parquet here)."""
    return {"README.md": CARD.encode(),
            "main/train-00000-of-00001.parquet": _parquet(ROWS["train"]),
            "main/test-00000-of-00001.parquet": _parquet(ROWS["test"]),
            "small/train.parquet": _parquet(SMALL["train"]), "small/test.parquet": _parquet(SMALL["test"])}


def _python(code: str) -> dict:
    """Run `code` in a fresh interpreter (this test's environment); the JSON it printed last."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_hub_id_resolves_to_its_snapshot_and_commit(cache, tiny_model_path):
    """main by default, a commit, a tag: each the snapshot directory it names, with its commit;
    model=local's target returns that directory."""
    files = _model_files(tiny_model_path)
    main = lay_out(cache, "model", MODEL_ID, files, _commit("main"), refs=("main",))
    tagged = lay_out(cache, "model", MODEL_ID, files | {"README.md": b"v1"}, _commit("v1"), refs=("v1",))
    got = _python(f"""
import json
from rlexp.data.hub import resolve
from rlexp.models.local import local_model
out = {{str(rev): list(vars(resolve({MODEL_ID!r}, rev)).values())
       for rev in (None, {_commit('main')!r}, "v1")}}
out["local_model"] = local_model({MODEL_ID!r})
out["local_model v1"] = local_model({MODEL_ID!r}, "v1")
print(json.dumps(out))
""")
    assert got["None"] == [str(main.resolve()), _commit("main")]
    assert got[_commit("main")] == [str(main.resolve()), _commit("main")]
    assert got["v1"] == [str(tagged.resolve()), _commit("v1")]
    assert got["local_model"] == str(main.resolve())
    assert got["local_model v1"] == str(tagged.resolve())
    assert (Path(got["local_model"]) / "config.json").read_bytes() == files["config.json"]


def test_an_offline_miss_is_one_line_naming_the_id_the_cache_and_hf_hub_offline(cache, tiny_model_path):
    lay_out(cache, "model", MODEL_ID, _model_files(tiny_model_path), _commit("main"))
    got = _python(f"""
import json
from rlexp.data.hub import resolve
from rlexp.data.sources import HubSource
from rlexp.errors import ConfigError
out = []
for args in (("nobody/nothing",), ("nobody/nothing", "v2"), ({MODEL_ID!r}, "v9"),
             ({MODEL_ID!r}, {_commit('other')!r}), ("nobody/data", None, "dataset", "name", "revision")):
    try:
        resolve(*args)
        out.append(None)
    except ConfigError as e:
        out.append(str(e))
print(json.dumps(out))
""")
    names = ["model.path=nobody/nothing", "model.path=nobody/nothing (model.revision=v2)",
             f"model.path={MODEL_ID} (model.revision=v9)",
             f"model.path={MODEL_ID} (model.revision={_commit('other')})",
             "name=nobody/data"]
    for message, name in zip(got, names, strict=True):
        assert message is not None and "\n" not in message
        assert message.startswith(f"{name}: not in the Hugging Face cache {cache}"), message
        assert "HF_HUB_OFFLINE=1" in message and "unset HF_HUB_OFFLINE" in message, message
    assert "`hf download nobody/nothing --revision v2`" in got[1]
    assert "`hf download nobody/data --repo-type dataset`" in got[4]


def test_an_offline_miss_stops_a_run_in_preflight_with_exit_code_2(cache, tmp_path):
    """Through `python -m rlexp.run`: one line on stderr, and none of torch, transformers, vLLM,
    MLflow or datasets imported by then (-X importtime lists what was)."""
    res = subprocess.run([sys.executable, "-X", "importtime", "-m", "rlexp.run", "model=local",
                          "model.path=nobody/nothing", f"hydra.run.dir={tmp_path}/run"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.splitlines()
    imported = {line.split("|")[-1].strip().split(".")[0]
                for line in lines if line.startswith("import time:")}
    others = [line for line in lines if not line.startswith("import time:")]
    assert len(others) == 1, others
    assert others[0].startswith(f"rlexp: config error: model.path=nobody/nothing: not in the Hugging Face "
                                f"cache {cache}"), others
    assert "HF_HUB_OFFLINE" in others[0]
    assert "huggingface_hub" in imported and not imported & set(HEAVY), imported & set(HEAVY)


def test_a_local_directory_wins_and_a_missing_local_path_keeps_its_error(cache, tiny_model_path,
                                                                       tmp_path, monkeypatch):
    """No hub involved: these never import huggingface_hub, so they run in this process."""
    lay_out(cache, "model", MODEL_ID, _model_files(tiny_model_path), _commit("main"))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_path, tmp_path / MODEL_ID)  # ./tiny-org/tiny-chat, also cached as a hub id
    assert local_model(MODEL_ID) == str(tmp_path / MODEL_ID)
    assert resolve(MODEL_ID).commit is None
    assert local_model(tiny_model_path) == tiny_model_path
    for missing in ("/nonexistent/model", "./tiny-org/missing", "~/no/such/model", "no-org-model"):
        with pytest.raises(ConfigError, match="no config.json there") as err:
            local_model(missing)
        assert str(err.value).startswith(f"model.path={missing}: ")
        assert "HF_HUB_OFFLINE" not in str(err.value)
    with pytest.raises(ConfigError, match="model.revision=v1 is a hub revision, but model.path=.* local"):
        local_model(tiny_model_path, "v1")
    with pytest.raises(FileNotFoundError, match=r"^\./no/data: no such directory, and not a hub dataset id"):
        HubSource("./no/data")


def test_a_hub_dataset_reads_through_load_dataset_like_a_local_directory(cache, tmp_path):
    """HubSource on the hub id (its configs from the card, in Parquet) and on a plain directory
    of JSON lines files: the rows as problems, named by id and split, and the commit."""
    snapshot = lay_out(cache, "dataset", DATA_ID, _dataset_files(), _commit("data"))
    plain = tmp_path / "plain"
    plain.mkdir()
    for split, rows in ROWS.items():
        (plain / f"{split}.jsonl").write_bytes(_jsonl(rows))
    got = _python(f"""
import json
from rlexp.data.sources import HubSource
def problems(**kw):
    try:
        s = HubSource(answer_pattern={PATTERN!r}, **kw)
    except ValueError as e:
        return str(e)
    return {{"commit": s.commit, "path": str(s.path),
            **{{split: [[p.messages, p.answer, p.where] for p in s.problems(split)]
               for split in ("train", "eval")}}}}
print(json.dumps({{
    "hub": problems(name={DATA_ID!r}, eval_split="test"),
    "small": problems(name={DATA_ID!r}, config="small", eval_split="test", revision={_commit('data')!r}),
    "held_out": problems(name={DATA_ID!r}, config="main", eval_size=10),
    "plain": problems(name={str(plain)!r}, eval_split="test"),
    "no_split": problems(name={DATA_ID!r}, eval_split="validation"),
}}))
""")

    def expected(rows, split):
        return [[[{"role": "user", "content": r["question"]}], r["answer"].split("#### ")[1],
                 f"{DATA_ID} {split}: row {i}"] for i, r in enumerate(rows)]

    hub = got["hub"]
    assert (hub["commit"], hub["path"]) == (_commit("data"), str(snapshot.resolve()))
    assert hub["train"] == expected(ROWS["train"], "train")
    assert hub["eval"] == expected(ROWS["test"], "test")
    small = got["small"]
    assert small["train"] == expected(SMALL["train"], "train")
    assert small["eval"] == expected(SMALL["test"], "test")
    held = got["held_out"]
    assert len(held["eval"]) == 10 and len(held["train"]) == len(ROWS["train"]) - 10
    assert {p[2]: p for p in held["train"] + held["eval"]} == {p[2]: p for p in hub["train"]}  # by row
    plain_got = got["plain"]
    assert plain_got["commit"] is None
    assert [p[:2] for p in plain_got["train"]] == [p[:2] for p in hub["train"]]
    assert [p[:2] for p in plain_got["eval"]] == [p[:2] for p in hub["eval"]]
    assert plain_got["train"][0][2] == f"{plain} train: row 0"
    assert got["no_split"] == (f"{DATA_ID}: no split 'validation' (has ['test', 'train']); "
                               "set data.source.eval_split")


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_names_its_model_and_data_by_hub_id(cache, tiny_model_path, tmp_path):
    """experiment=smoke with both from the offline hub cache: the run finishes and MLflow has the
    resolved directory and commit. The tiny model's lengths and lr over model=local's."""
    from mlflow.tracking import MlflowClient

    snapshot = lay_out(cache, "model", MODEL_ID, _model_files(tiny_model_path), _commit("model"))
    lay_out(cache, "dataset", DATA_ID, _dataset_files(), _commit("data"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", "experiment=smoke", "model=local", f"model.path={MODEL_ID}",
           "data=hub", f"data.source.name={DATA_ID}", "data.source.eval_split=test",
           "rollout.max_model_len=256", "rollout.max_response_tokens=8", "trainer.optimizer.lr=5e-4",
           "trainer.warmup_steps=0", f"logger.tracking_uri={uri}", "logger.experiment_name=test",
           f"logger.artifact_location={tmp_path}/artifacts", f"hydra.run.dir={tmp_path}/out"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test").experiment_id])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert (params["model.path"], params["model.commit"]) == (MODEL_ID, _commit("model"))
    assert params["model.resolved_path"] == str(snapshot.resolve())
    assert (params["data.source.name"], params["data.commit"]) == (DATA_ID, _commit("data"))
    saved = OmegaConf.load(tmp_path / "out" / RUN_CONFIG)  # what resume=... reads: pinned commits
    assert (saved.model.revision, saved.data.source.revision) == (_commit("model"), _commit("data"))
    loss_steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert loss_steps == [1, 2, 3]
