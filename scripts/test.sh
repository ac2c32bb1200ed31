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
# Distributions whose tests start Ray clusters and servers with timing checks (restarts, heartbeats, limits) run
# one test at a time; in the others, the tests that are not marked `distributed` run two at a time (pytest-xdist,
# whole files per worker so module fixtures stay shared): each uses one core (TWINKLE_TEST_THREADS=1) and the
# machine has two. The `distributed` tests (torchrun jobs of 2-4 ranks, which use both cores) run one at a time.
SERIAL="twinkle-ray/tests twinkle-server/tests"
PARALLEL=${TWINKLE_TEST_WORKERS:-2}
# One pytest process per distribution (and per phase), with the repository's configuration (-c pyproject.toml):
# the memory of one distribution's tests is returned before the next starts. A run that selects none of a
# distribution's tests (exit 5) is fine; a test command that selects nothing at all is not.
status=0
ran=0
pytest_in() {  # pytest_in PATH ARGS...: run pytest on one distribution's tests, record the outcome
    local path=$1 code
    shift
    set +e
    "$VENV/bin/python" -m pytest "$path" -c pyproject.toml --rootdir . --import-mode=importlib -p no:cacheprovider "$@"
    code=$?
    set -e
    case "$code" in
        0) ran=1 ;;
        5) ;;
        *) status=$code; echo "=== $path: pytest exited with $code ===" >&2 ;;
    esac
}
run_pytest() {  # run_pytest MARKER-EXPRESSION ARGS...
    local expr=$1 path
    shift
    for path in "${paths[@]}"; do
        if [ "$PARALLEL" -gt 1 ] && [[ " $SERIAL " != *" $path "* ]]; then
            pytest_in "$path" -m "($expr) and not distributed" -n "$PARALLEL" --dist loadfile "$@"
            pytest_in "$path" -m "($expr) and distributed" "$@"
        else
            pytest_in "$path" -m "$expr" "$@"
        fi
    done
}
# Every test with one thread per process; then the in-process parity tests again with two threads: their
# tolerances come from the arithmetic (twinkle_core.testing.tolerance), so they must hold for any thread count's
# reduction order (`nox -s parity` reruns every parity test, the multi-process ones too, with two threads).
TWINKLE_TEST_THREADS=1 run_pytest "not slow" "$@"
if [ "$#" -eq 0 ]; then
    echo "=== the in-process parity tests again, with 2 threads per process ==="
    PARALLEL=1 TWINKLE_TEST_THREADS=2 run_pytest "parity and not slow and not distributed" -q
fi
if [ "$status" -eq 0 ] && [ "$ran" -eq 0 ]; then
    echo "pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$status"
