#!/usr/bin/env bash
# TRL beside the project, for bench/vs_trl.py only (never a runtime dependency of rlexp):
# its own venv, .venv-trl, that sees .venv's packages through a .pth file, so TRL runs the
# very torch, transformers and vllm(-cpu) that rlexp runs (its vLLM mode included); pip adds
# TRL and whatever TRL needs beyond them into .venv-trl alone.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m venv .venv-trl
site() { "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"; }
site .venv/bin/python > "$(site .venv-trl/bin/python)/rlexp-venv.pth"
.venv-trl/bin/pip install -q --no-warn-conflicts "trl==1.16.0"
.venv-trl/bin/python -c "import trl, torch, transformers, vllm; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
