#!/usr/bin/env bash
# The main job: prepare the environment, train the bundled quickstart, then chat with the result
# through plain transformers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${TWINKLE_VENV:-.venv}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$VENV/bin/twinkle" train examples/quickstart/recipe.yaml "$@"
"$VENV/bin/python" examples/quickstart/generate.py outputs/quickstart/final
