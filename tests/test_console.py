"""What rlexp silences of third-party output (rlexp/console.py), and that a user's choice wins."""

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
