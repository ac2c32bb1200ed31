#!/usr/bin/env bash
# Create .venv (once) and install Twinkle with every distribution in this repository, editable.
# torch is installed first and pinned (torch==2.13.0, a CPU build) so pip never resolves a bare
# `torch` to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${TWINKLE_VENV:-.venv}
TORCH_SPEC=${TWINKLE_TORCH:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    pip install "$TORCH_SPEC"
fi
pip install -r requirements/dev.txt
stamp="$VENV/.twinkle-installed"
if [ ! -f "$stamp" ] || [ -n "$(find . -name pyproject.toml -newer "$stamp" -not -path "./$VENV/*" -not -path "./.nox/*" | head -1)" ]; then
    args=(-e .)
    for dist in twinkle-backend-hf twinkle-backend-megatron twinkle-backend-npu twinkle-ray twinkle-server plugins/*/; do
        [ -f "$dist/pyproject.toml" ] && args+=(-e "$dist")
    done
    pip install "${args[@]}"
    touch "$stamp"
fi
"$VENV/bin/python" -c 'import torch; print(f"twinkle environment ready (torch {torch.__version__})")'
