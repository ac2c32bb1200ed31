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
# Two test files at a time (pytest-xdist, whole files per worker, so module fixtures stay shared): a test process
# uses one thread (TWINKLE_TEST_THREADS=1) and a 2-rank torchrun job waits on its collectives, so two at a time fill
# the 2 cores better than one (the HF backend's 2-rank tests: 380 s -> 303 s; the core's: 607 s -> 356 s).
# twinkle-ray and twinkle-server run one test at a time: their tests check restarts, heartbeats and limits with
# timings.
SERIAL="twinkle-ray/tests twinkle-server/tests"
PARALLEL=${TWINKLE_TEST_WORKERS:-2}
# One pytest process per distribution, with the repository's configuration (-c pyproject.toml):
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
            pytest_in "$path" -m "$expr" -n "$PARALLEL" --dist loadfile "$@"
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
