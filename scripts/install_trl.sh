#!/usr/bin/env bash
# TRL beside the project, for bench/vs_trl.py only (never a runtime dependency of rlexp):
# its own venv, .venv-trl, with the same torch (CPU build) and transformers as .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
TRANSFORMERS=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
TORCH=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
python3 -m venv .venv-trl
.venv-trl/bin/pip install -q --upgrade pip
.venv-trl/bin/pip install -q "torch==$TORCH" "transformers==$TRANSFORMERS" "trl==1.16.0"
.venv-trl/bin/python -c "import trl, torch, transformers; print('trl', trl.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
