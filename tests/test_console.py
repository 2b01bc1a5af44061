"""What rlexp silences of third-party output (rlexp/console.py), and that a user's choice wins."""

import logging
import os

from rlexp.console import REDUCE_OP_WARNING, quiet_third_party


def test_quiet_defaults_leave_a_users_settings_alone(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)  # restored afterwards
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("PYTHONWARNINGS", "error::UserWarning")
    for _ in range(2):  # a sweep calls it once per job
        quiet_third_party()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert os.environ["PYTHONWARNINGS"] == f"error::UserWarning,{REDUCE_OP_WARNING}"
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    quiet_third_party()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"


def test_only_vllms_seed_warning_is_dropped(monkeypatch):
    """The one vLLM warning that rlexp's own setting causes is dropped (once, however often
    this is called); vLLM's other warnings from the same place still show."""
    logger = logging.getLogger("vllm.engine.arg_utils")
    monkeypatch.setattr(logger, "filters", [])  # as before any call (restored afterwards)

    def shown(message: str) -> bool:
        return bool(logger.filter(logger.makeRecord(logger.name, logging.WARNING, "arg_utils.py", 1, message,
                                                    (), None)))

    seed = "The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, ..."
    assert shown(seed % 0)
    quiet_third_party()
    quiet_third_party()
    assert not shown(seed % 0) and len(logger.filters) == 1
    assert shown("This model does not officially support disabling chunked prefill.")
