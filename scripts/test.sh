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
for dist in twinkle-backend-hf twinkle-backend-megatron twinkle-backend-npu twinkle-ray twinkle-server plugins/*/; do
    [ -d "$dist/tests" ] && paths+=("${dist%/}/tests")
done
run_pytest() {
    set +e
    "$VENV/bin/python" -m pytest "${paths[@]}" --import-mode=importlib -p no:cacheprovider "$@"
    local status=$?
    set -e
    if [ "$status" -eq 5 ]; then
        echo "pytest collected no tests: failing on purpose" >&2
        return 1
    fi
    return "$status"
}
# Every test with one thread per process, then the parity tests again with two: their tolerances come from
# the arithmetic (twinkle_core.testing.tolerance), so they must hold for any thread count's reduction order.
TWINKLE_TEST_THREADS=1 run_pytest -m "not slow" "$@"
if [ "$#" -eq 0 ]; then
    echo "=== the parity tests again, with 2 threads per process ==="
    TWINKLE_TEST_THREADS=2 run_pytest -m "parity and not slow" -q
fi
