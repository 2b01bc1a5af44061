#!/usr/bin/env bash
# Creates one venv per environment library, each exactly its pins (requirements/envs/*.txt):
#   .venv-verifiers  verifiers (agent=verifiers runs its environments there)
#   .venv-openenv    openenv-core (OpenEnv servers for agent=openenv run there)
#   .venv-tinker     tinker + tinker-cookbook, CPU torch (Tinker API clients of rlexp's Tinker server)
# Each library pins packages the main lock cannot have (verifiers: openai<3, mcp==2.0.0;
# openenv: certifi>=2026.10.19, pillow<13; tinker-cookbook: an overridden tml-renderers), so each
# runs in its own Python, as a child process talking to rlexp over pipes and HTTP. rlexp itself
# never imports them. `make run` does not need them; `make envs` (and `make test`) creates them.
# Name some: scripts/install_envs.sh verifiers. Torch comes from the CPU indexes (as install.sh:
# TORCH_INDEX_URL, where the registry has no CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/uv ] || bash scripts/install.sh
PYTHON="${PYTHON:-python3}"
mapfile -t indexes < <(.venv/bin/python scripts/pins.py index-args cpu)
[ -n "${TORCH_INDEX_URL:-}" ] && indexes+=(--extra-index-url "$TORCH_INDEX_URL")
for env in "${@:-verifiers openenv tinker}"; do
  for name in $env; do
    lock="requirements/envs/$name.txt"
    [ -f "$lock" ] || { echo "install_envs: no pins for '$name' ($lock)"; exit 2; }
    [ -x ".venv-$name/bin/python" ] || "$PYTHON" -m venv ".venv-$name"
    .venv/bin/uv pip sync --compile-bytecode --python ".venv-$name/bin/python" "${indexes[@]}" "$lock"
    echo "install_envs: .venv-$name = $lock ($(grep -c '==' "$lock") packages)"
  done
done
