"""`rlexp tinker` is the Tinker API server's command: Hydra-configured like a run, and it
refuses to serve off loopback without an API key before anything starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RLEXP = Path(sys.executable).parent / "rlexp"


def test_rlexp_tinker_composes_the_server_config(tmp_path):
    out = subprocess.run([str(RLEXP), "tinker", "--cfg", "job", "tinker.port=1234", "model.hidden_size=64"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "port: 1234" in out.stdout and "base_model: rlexp/tiny-chat" in out.stdout
    assert "hidden_size: 64" in out.stdout and "lr_schedule: constant" in out.stdout


def test_serving_off_loopback_needs_an_api_key_and_stops_before_any_engine(tmp_path):
    out = subprocess.run([sys.executable, "-m", "rlexp.tinker", "tinker.host=0.0.0.0",
                          f"tinker.state_dir={tmp_path / 'state'}", f"hydra.run.dir={tmp_path / 'h'}"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode != 0
    assert "without tinker.api_key" in out.stderr and "vLLM engine up" not in out.stderr
    assert not (tmp_path / "state").exists()
