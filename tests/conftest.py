import asyncio
import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.durations import group_seconds

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Ray's token authentication, as a local ray.init() turns it on by default; set before Ray is
# imported (it reads the mode once), so that this process can also join the multi-node
# clusters of tests/ray_nodes.py, which use the same token (~/.ray/auth_token).
os.environ.setdefault("RAY_AUTH_MODE", "token")

TINY_KW = dict(seed=0, hidden_size=128, num_layers=2, num_heads=2, warm_start_steps=40,
               warm_start_batch_size=32, warm_start_lr=0.002, warm_start_target_accuracy=1.0,
               task_max_operand=29, task_ops="+",
               task_eval_size=200, task_seed=0)


# Files whose tests start Ray clusters on this host: `make test`'s workers run them one after
# another on one worker, because `cluster.address=auto` joins the newest cluster started on the
# host, whichever test started it.
RAY_FILES = ("test_cluster.py", "test_cluster_runs.py", "test_pool_bounds.py", "test_ray_gpu.py")
# The files of tests/server_vllm/, whose engine is package-scoped: run on one worker without
# other files in between, it starts once.
SERVER_VLLM_FILES = tuple(sorted(p.name for p in (Path(__file__).parent / "server_vllm").glob("test_*.py")))


def pytest_collection_modifyitems(config, items):
    """vLLM, Ray and reasoning-gym are pinned (requirements/): a test that needs one imports it
    and fails if the install is broken; only a missing GPU skips. The costliest files come
    first (tests/durations.py): on `make test`'s workers no long file starts last."""
    has_cuda = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    cost = group_seconds((work_unit(item.nodeid) for item in items),
                         {"ray": RAY_FILES, "server_vllm": SERVER_VLLM_FILES})
    items.sort(key=lambda item: -cost[work_unit(item.nodeid)])  # stable: a file's tests keep their order


def work_unit(nodeid: str) -> str:
    """What one worker runs as a whole: a test file (its module's engine starts once), the
    Ray files together, or tests/server_vllm/ together (its package's engine starts once)."""
    directory, _, name = nodeid.split("::")[0].rpartition("/")
    if directory.rsplit("/", 1)[-1] == "server_vllm":
        return "server_vllm"
    return "ray" if name in RAY_FILES else name


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler of whole files (`--dist loadfile`), with `work_unit` as the
    file, and in the order collected (the costliest first)."""
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return WorkUnits(config, log)


@pytest.fixture(scope="session")
def tiny_model_path(rlexp_cache) -> str:
    from rlexp.models.tiny import build_tiny_model

    return build_tiny_model(str(rlexp_cache / "models"), **TINY_KW)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def vlm_path(tmp_path_factory) -> str:
    """The tiny vision-language model (random weights, rlexp/models/vlm.py), built once."""
    from rlexp.models.vlm import build_vlm_model

    return build_vlm_model(str(tmp_path_factory.mktemp("vlm")), seed=0, warm_start_steps=0)


@pytest.fixture(scope="session")
def arch_paths(tmp_path_factory) -> dict[str, str]:
    """The real architectures of test_architectures.py (BUILDS), built once per session."""
    from rlexp.models.arch import build_arch_model
    from tests.test_architectures import BUILDS

    cache = str(tmp_path_factory.mktemp("arch-models"))
    return {name: build_arch_model(cache_dir=cache, seed=0, **kw) for name, kw in BUILDS.items()}


@pytest.fixture(scope="session", autouse=True)
def rlexp_cache(tmp_path_factory):
    """RLEXP_CACHE, rlexp's cache (its models under `models/`, the default `model.cache_dir`),
    for the whole session and the runs it starts: one of the suite's own, never the user's
    ~/.cache/rlexp."""
    # One for the whole suite, its pytest workers included: a model is built once, by the
    # first worker that asks for it (the others wait on its build lock, rlexp/models/tiny.py).
    cache = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        cache = cache.parent  # the session's directory, above each worker's own
    cache = cache / "rlexp-cache"
    cache.mkdir(exist_ok=True)
    os.environ["RLEXP_CACHE"] = str(cache)
    return cache


@pytest.fixture(scope="session")
def run_models(rlexp_cache):
    """`model.cache_dir` of the whole-run tests (test_run, test_resume, test_sweep and others),
    the session's default one: their runs build the same tiny model (same arguments, same cache
    key), so it is built once."""
    return rlexp_cache / "models"


@pytest.fixture(scope="session")
def new_store(tmp_path_factory):
    """`new_store(dir)` makes `dir` and puts an empty MLflow SQLite store in it
    (`dir/mlflow.db`), its tables made: MLflow's migrations, which every new store runs, take
    seconds (mostly disk syncs), so they run once and each whole-run test copies the result."""
    import shutil

    from mlflow.tracking import MlflowClient

    template = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{template}").search_experiments()  # creates the tables

    def make(directory):
        directory.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, directory / "mlflow.db")
        return directory

    return make


@pytest.fixture
def run_temp(monkeypatch):
    """A temporary root of this test's own (`RLEXP_TEMP_DIR`, inherited by the runs it starts):
    their weight files, vLLM's sockets and every temporary file go there, so that "a killed run
    leaves nothing" is checked on this directory, never on the machine's /dev/shm or /tmp, where
    other workers' runs write. Short (a unix socket's path is at most 107 bytes) and in RAM."""
    import shutil
    import tempfile
    from pathlib import Path

    from rlexp import orphans

    root = Path(tempfile.mkdtemp(prefix="rt-", dir=orphans.ram_root()))
    monkeypatch.setenv(orphans.TEMP_DIR_ENV, str(root))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_leaked_tracking_uri():
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI: keep one test's store out of the
    subprocesses the next test starts."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@contextlib.contextmanager
def vllm_on_thread(model_path: str, failsafe_s: float, **engine_kwargs):
    """One real vLLM engine on an event loop in a background thread (the engine belongs to the
    loop it was made on). Yields (engine, run): `run(coro)` runs a coroutine there, failing
    after `failsafe_s` so that a hang becomes a failure."""
    from rlexp.rollout.vllm_engine import VLLMEngine

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, failsafe_s), loop).result()

    async def start():
        return VLLMEngine(model_path, **engine_kwargs)

    engine = run(start())
    try:
        yield engine, run
    finally:
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


@pytest.fixture(scope="module")
def openenv_python() -> str:
    """The Python of OpenEnv's venv (.venv-openenv), where the OpenEnv servers of the
    environment tests run; missing, the tests that need it fail, saying how to make it."""
    from tests.environment_helpers import OPENENV_PYTHON

    if not OPENENV_PYTHON.is_file():
        pytest.fail(f"{OPENENV_PYTHON} is missing: run `make envs` (scripts/install_envs.sh openenv) "
                    "to create OpenEnv's venv", pytrace=False)
    return str(OPENENV_PYTHON)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """A Ray cluster of three nodes on this host (tests/ray_nodes.py): a head with no CPUs,
    where a driver started here connects, and two worker nodes of 2 CPUs."""
    from tests.ray_nodes import RayNodes

    nodes = RayNodes(tmp_path_factory.mktemp("ray_nodes")).start()
    try:
        nodes.add_node(cpus=2)
        nodes.add_node(cpus=2)
        yield nodes
    finally:
        left = nodes.stop()
    assert not left, left


@pytest.fixture
def killed(monkeypatch) -> list[tuple[Any, bool]]:
    """The (fake) replicas a RolloutPool asks Ray to kill, and whether they may restart; Ray's
    cancel of a timed-out call is a no-op on a fake."""
    import ray

    calls: list[tuple[Any, bool]] = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: calls.append((actor, no_restart)))
    monkeypatch.setattr(ray, "cancel", lambda ref: None)
    return calls
