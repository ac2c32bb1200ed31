#!/usr/bin/env bash
# Check Twinkle on one CUDA GPU: the core's conformance suite on the cuda accelerator, a bf16 step against fp32,
# and bench/gpu_check.py (tokens/s, MFU and peak memory of a 0.5B-class model against transformers.Trainer).
#
#   bash scripts/check_on_gpu.sh [OUT_DIR]
#
# Needs a CUDA build of torch with a visible GPU, and transformers, peft, accelerate, safetensors, pluggy, pyyaml,
# tqdm and pytest already installed: twinkle-core and twinkle-backend-hf are installed from this checkout without
# dependencies and without an index, so the script also runs on a machine with no network. Writes OUT_DIR/
# {environment.txt,conformance.xml,bf16_step.json,gpu_check.json} (default OUT_DIR: ./gpu_check_<date>) and exits
# non-zero when a check fails. Environment: PYTHON (default python3), CONFORMANCE_TIMEOUT (s, default 240),
# BENCH_TIMEOUT (s, default 330), BENCH_ARGS (extra arguments for bench/gpu_check.py).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT_DIR="$(realpath -m "${1:-gpu_check_$(date +%Y%m%d_%H%M%S)}")"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TWINKLE_NO_PROGRESS=1

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "check_on_gpu: $PYTHON sees no CUDA GPU (torch.cuda.is_available() is False): run this on a machine with" \
         "an NVIDIA GPU and a CUDA build of torch." >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
"$PYTHON" -m pip install -q --no-deps --no-build-isolation --no-index -e . -e twinkle-backend-hf || exit 2

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PYTHON" -c 'import torch, transformers, peft; print("torch", torch.__version__, "cuda", torch.version.cuda,
"| transformers", transformers.__version__, "| peft", peft.__version__)'
    "$PYTHON" -m twinkle_core.cli plugins --probe 2>&1 | sed -n '/^accelerators:/,$p'
} 2>&1 | tee "$OUT_DIR/environment.txt"

status=0
echo "=== conformance: TransformersModel on the cuda accelerator ==="
timeout "${CONFORMANCE_TIMEOUT:-240}" "$PYTHON" -m pytest --pyargs twinkle_core.testing.conformance \
    --twinkle-backend hf -p no:cacheprovider -q -W ignore --junitxml "$OUT_DIR/conformance.xml" || status=1

echo "=== bf16 step against fp32 (tiny Qwen2) ==="
"$PYTHON" - "$OUT_DIR/bf16_step.json" <<'PY' || status=1
import json, sys

import torch
from twinkle_backend_hf.testing import make_tiny_model

from twinkle_core.testing.conformance import make_batch

results = {}
for precision in ("no", "bf16"):
    model = make_tiny_model(precision=precision)
    configs = model.get_train_configs()
    assert configs["accelerator"] == "cuda", configs["accelerator"]
    device = next(model.hf_model.parameters()).device
    assert device.type == "cuda", device
    model.set_optimizer("AdamW", lr=1e-2)
    losses = []
    for step in range(5):
        model.forward_backward(inputs=make_batch(step))
        model.clip_grad_and_step(max_grad_norm=1.0)
        losses.append(float(model.calculate_metric()["loss"]))
    results[precision] = {"losses": losses, "device": str(device), "peak_mib": torch.cuda.max_memory_allocated() / 2**20}
    print(precision, results[precision])
gap = max(abs(a - b) for a, b in zip(results["no"]["losses"], results["bf16"]["losses"]))
results["max_loss_gap"] = gap
json.dump(results, open(sys.argv[1], "w"), indent=2)
# bf16 keeps 8 bits of mantissa (relative rounding 2**-9): a 5-step loss of ~4 may move by a few hundredths
assert gap < 0.1, f"bf16 losses differ from fp32 by {gap:.3g}"
print(f"bf16 vs fp32: max loss gap {gap:.3g} over 5 steps")
PY

echo "=== bench/gpu_check.py ==="
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-330}" "$PYTHON" bench/gpu_check.py --out-dir "$OUT_DIR" ${BENCH_ARGS:-} || status=1
echo "check_on_gpu: $([[ $status -eq 0 ]] && echo passed || echo FAILED); results in $OUT_DIR"
exit $status
