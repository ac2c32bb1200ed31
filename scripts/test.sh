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
# One pytest process per distribution, with the repository's configuration (-c pyproject.toml): the memory of one
# distribution's tests is returned before the next starts (one process for every test grew to 23 GB and was
# killed by the kernel at 95%). A distribution none of whose tests is selected (exit 5) is fine; none at all is not.
run_pytest() {
    local status=0 ran=0 code path
    for path in "${paths[@]}"; do
        set +e
        "$VENV/bin/python" -m pytest "$path" -c pyproject.toml --rootdir . --import-mode=importlib -p no:cacheprovider "$@"
        code=$?
        set -e
        case "$code" in
            0) ran=1 ;;
            5) ;;
            *) status=$code ;;
        esac
    done
    if [ "$status" -eq 0 ] && [ "$ran" -eq 0 ]; then
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
