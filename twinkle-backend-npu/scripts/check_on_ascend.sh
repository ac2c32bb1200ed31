#!/usr/bin/env bash
# Check Twinkle on an Ascend host: bf16 parity against the CPU, per-kernel speed-ups, a 2-rank HCCL run.
#
#   bash twinkle-backend-npu/scripts/check_on_ascend.sh [OUT_DIR]
#
# Needs: torch + torch_npu + the CANN toolkit (its set_env.sh is sourced when found), twinkle-core,
# twinkle-backend-hf and twinkle-backend-npu installed, and two visible NPUs for the HCCL run
# (ASCEND_RT_VISIBLE_DEVICES picks them). Writes OUT_DIR/{parity,kernels,hccl}.json and OUT_DIR/summary.json
# (default OUT_DIR: ./ascend_check_<date>) and exits non-zero when any check fails or cannot run.
# Environment: PYTHON (default python3), CHECK_ARGS (extra arguments for every check, e.g. "--hidden 1024").

PYTHON="${PYTHON:-python3}"
OUT_DIR="${1:-ascend_check_$(date +%Y%m%d_%H%M%S)}"
CANN_ENV="${ASCEND_TOOLKIT_HOME:-/usr/local/Ascend/ascend-toolkit/latest}/../set_env.sh"
if [[ -z "${ASCEND_HOME_PATH:-}" && -f "$CANN_ENV" ]]; then
    # set_env.sh reads unset variables, so it is sourced before `set -u`
    # shellcheck disable=SC1090
    source "$CANN_ENV"
fi
set -euo pipefail

if ! "$PYTHON" -c "import torch_npu" 2>/dev/null; then
    echo "check_on_ascend: torch_npu cannot be imported by $PYTHON: this script runs on an Ascend host with torch," \
         "torch_npu and CANN installed (source /usr/local/Ascend/ascend-toolkit/set_env.sh, then" \
         "pip install -e twinkle-backend-npu[ascend])." >&2
    "$PYTHON" -m twinkle_backend_npu.hardware_check versions >&2 || true
    exit 2
fi

mkdir -p "$OUT_DIR"
status=0
results=()
for check in parity kernels hccl; do
    echo "=== $check ==="
    # shellcheck disable=SC2086
    if "$PYTHON" -m twinkle_backend_npu.hardware_check "$check" --json "$OUT_DIR/$check.json" ${CHECK_ARGS:-}; then
        results+=("\"$check\": \"pass\"")
    else
        results+=("\"$check\": \"fail\"")
        status=1
    fi
done

summary="$OUT_DIR/summary.json"
{
    echo "{"
    echo "  \"results\": {$(IFS=,; echo "${results[*]}")},"
    echo "  \"versions\": $("$PYTHON" -c 'import json; from twinkle_backend_npu.hardware_check import versions; print(json.dumps(versions()))'),"
    echo "  \"passed\": $([[ $status -eq 0 ]] && echo true || echo false)"
    echo "}"
} > "$summary"
cat "$summary"
echo "check_on_ascend: $([[ $status -eq 0 ]] && echo PASS || echo FAIL); details in $OUT_DIR/"
exit "$status"
