"""What third-party libraries print during a run, and why some of it is silenced. Called once
by `python -m rlexp.run` before vLLM is imported; set the variables yourself to see it all."""

from __future__ import annotations

import logging
import os
import sys
import warnings

# vLLM 0.32's triton dispatcher touches torch.distributed.reduce_op, deprecated in torch 2.13:
# two FutureWarnings per process start, in vLLM's code, not ours to fix.
REDUCE_OP_WARNING = "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"

# Started on the CPU, vLLM warns that VLLM_ENABLE_V1_MULTIPROCESSING=0 "may affect the random
# state of the Python process that launched vLLM". rlexp sets it while an engine starts only so
# that vLLM keeps its worker in the engine core's process (rlexp/rollout/vllm_args.py); the
# engine core still runs in a process of its own, and a run's numbers are the same either way.
SEED_WARNING = "The global random seed is set to"


class _NoSeedWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(SEED_WARNING)


def quiet_third_party() -> None:
    # vLLM logs four INFO lines per weight update (pause, reset prefix cache, reload, unpause)
    # and ten at shutdown; rlexp's step line says the same once. Its warnings still show.
    # VLLM_LOGGING_LEVEL=INFO brings them back. Env vars: they reach vLLM's engine processes.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    filters = os.environ.get("PYTHONWARNINGS", "")
    if REDUCE_OP_WARNING not in filters:
        os.environ["PYTHONWARNINGS"] = f"{filters},{REDUCE_OP_WARNING}".lstrip(",")
    warnings.filterwarnings("ignore", message=REDUCE_OP_WARNING.split(":")[1], category=FutureWarning)
    # Progress bars (vLLM's and transformers' weight loading, via tqdm) redraw with "\r" even
    # into a file; off when the output is not a terminal (tqdm reads TQDM_* when imported).
    if not sys.stdout.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
    # MLflow: "Flushing the async trace logging queue before program exit", "Creating initial
    # MLflow database tables" are INFO about its own housekeeping.
    # httpx: one INFO line per request ("HTTP Request: POST ... 200 OK"), a teacher=openai
    # run's every score and an OpenAI client's every call; httpcore: its DEBUG trace.
    for name in ("mlflow.tracing.export.async_export_queue", "mlflow.store.db.utils", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)
    arg_utils = logging.getLogger("vllm.engine.arg_utils")
    if not any(isinstance(f, _NoSeedWarning) for f in arg_utils.filters):
        arg_utils.addFilter(_NoSeedWarning())
