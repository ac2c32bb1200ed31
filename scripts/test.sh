#!/usr/bin/env bash
# The test command: prepare the environment, then run every distribution's tests (slow ones excluded).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k fsdp`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
VENV=${TWINKLE_VENV:-.venv}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/twinkle/torch_extensions}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TWINKLE_NO_PROGRESS=1
paths=(tests)
for dist in twinkle-backend-hf twinkle-backend-megatron twinkle-backend-npu plugins/*/; do
    [ -d "$dist/tests" ] && paths+=("${dist%/}/tests")
done
set +e
"$VENV/bin/python" -m pytest "${paths[@]}" -m "not slow" --import-mode=importlib -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$status"
