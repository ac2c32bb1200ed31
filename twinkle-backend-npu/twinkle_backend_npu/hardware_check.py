"""What an owner of Ascend hardware runs to check Twinkle on it (``scripts/check_on_ascend.sh`` runs all three).

``python -m twinkle_backend_npu.hardware_check parity``
    bf16 autocast on the NPU against float32 on the CPU, same tiny Qwen2 weights: the logits' and the loss's
    largest difference against a bound derived from bf16's rounding (:func:`bf16_logits_bound`), once with the
    plain Hugging Face modules and once with the registered fused kernels applied.
``python -m twinkle_backend_npu.hardware_check kernels``
    forward + backward time with each registered NPU kernel applied alone, against none applied (and the fused
    optimizer's step against torch's AdamW). Speed-ups are reported, not judged; a kernel that fails to run or
    gives a non-finite loss fails the check.
``python -m twinkle_backend_npu.hardware_check hccl``
    a 2-rank torchrun job over HCCL (:mod:`twinkle_backend_npu.hardware_check_hccl`).

Each prints the torch / torch_npu / CANN versions, writes its result as JSON (``--json PATH``) and exits 1 when
the check fails, 2 when it cannot run here (no torch_npu, no NPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: where CANN's toolkit records its version (``ASCEND_TOOLKIT_HOME`` / ``ASCEND_HOME_PATH`` override the root)
CANN_VERSION_FILE = "/usr/local/Ascend/ascend-toolkit/latest/version.cfg"
#: bf16 operations in series per decoder layer under autocast, each rounding its inputs to bf16: the q/k/v
#: projections, the attention scores, the softmax, probabilities x values, the output projection, gate/up, the
#: SwiGLU product and the down projection
BF16_STAGES_PER_LAYER = 8


class CannotRun(RuntimeError):
    """The check cannot run on this machine (exit code 2); the message says what is missing."""


# ---------------------------------------------------------------------- environment
def cann_version() -> str | None:
    roots = [os.environ.get("ASCEND_TOOLKIT_HOME"), os.environ.get("ASCEND_HOME_PATH")]
    candidates = [Path(root) / "version.cfg" for root in roots if root] + [Path(CANN_VERSION_FILE)]
    for path in candidates:
        if path.is_file():
            lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if "version" in line]
            # toolkits write ``version=8.0.RC3``; older ones only ``runtime_running_version=[...]`` and the like
            exact = [line for line in lines if line.startswith("version=")]
            return "; ".join(exact or lines) or None
    return os.environ.get("CANN_VERSION")


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "torch_npu", "transformers", "twinkle-core", "twinkle-backend-npu"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    found["torch_npu (imported)"] = getattr(sys.modules.get("torch_npu"), "__version__", None)
    found["cann"] = cann_version()
    return found


def npu_accelerator() -> Any:
    """The ``npu`` accelerator, or :class:`CannotRun` with its reason (torch_npu missing, no CANN, versions)."""
    from twinkle_core.accelerator import current_accelerator
    from twinkle_core.errors import PluginNotFoundError, UnsupportedHardwareError

    os.environ.setdefault("TWINKLE_ACCELERATOR", "npu")
    try:
        accelerator = current_accelerator()
    except PluginNotFoundError as exc:
        raise CannotRun(f"{exc} (is twinkle-backend-npu installed? pip install -e twinkle-backend-npu)") from exc
    except UnsupportedHardwareError as exc:  # the accelerator's own refusal names the fix
        raise CannotRun(str(exc)) from exc
    if accelerator.name != "npu":
        raise CannotRun(f"the active accelerator is {accelerator.name!r}, not 'npu' (TWINKLE_ACCELERATOR="
                        f"{os.environ['TWINKLE_ACCELERATOR']!r}); unset TWINKLE_ACCELERATOR or set it to npu")
    return accelerator


# ---------------------------------------------------------------------- the tiny model
def tiny_qwen2(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(
        "qwen2", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
        max_position_embeddings=max(64, args.seq), tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)


def token_batch(args: argparse.Namespace, seed: int = 0) -> Any:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)


def _kernel_names(accelerator: Any) -> list[str]:
    from twinkle_core.kernels import enabled_kernels

    return [record.name for record in enabled_kernels(accelerator.name)]


def _only(names: list[str], keep: str | None) -> dict[str, bool]:
    """The kernel switch with ``keep`` on and every other kernel off (``keep=None``: all off)."""
    return {name: name == keep for name in names}


# ---------------------------------------------------------------------- (1) bf16 parity
def bf16_logits_bound(magnitude: float, layers: int) -> float:
    """How far bf16-autocast logits can be from float32 ones.

    Each bf16 operation rounds its two operands to bf16 (relative error ``u = 2**-8`` each), so a product of
    ``sum |x_i w_i| = magnitude`` moves by at most ``2 u magnitude`` (the float32 accumulation adds far less).
    Layer norms keep activations of order one, so the stages' errors add rather than compound: ``layers`` times
    :data:`BF16_STAGES_PER_LAYER` stages plus the output projection, on the output projection's ``magnitude``."""
    import torch

    u = torch.finfo(torch.bfloat16).eps / 2
    return (layers * BF16_STAGES_PER_LAYER + 1) * 2 * u * magnitude


def _forward(model: Any, input_ids: Any, autocast: str | None) -> tuple[Any, Any, float]:
    """Logits (float32, on the CPU), the loss and the output projection's largest ``sum |h_i w_i|``."""
    import contextlib

    import torch

    seen: list[float] = []
    head = model.get_output_embeddings()

    def record(_module: Any, inputs: tuple[Any, ...]) -> None:
        seen.append(float((inputs[0].detach().float().abs() @ head.weight.detach().float().abs().t()).max()))

    hook = head.register_forward_pre_hook(record)
    scope = torch.autocast(autocast, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with torch.no_grad(), scope:
            out = model(input_ids=input_ids, labels=input_ids)
    finally:
        hook.remove()
    return out.logits.float().cpu(), float(out.loss), seen[0]


def check_parity(args: argparse.Namespace) -> dict[str, Any]:
    from twinkle_core.kernels import apply_kernels

    accelerator = npu_accelerator()
    if not accelerator.supports_bf16():
        raise CannotRun("this NPU does not support bf16 (e.g. Atlas 300I / 910 first generation); nothing to check")
    base, input_ids = tiny_qwen2(args).eval(), token_batch(args)
    want_logits, want_loss, magnitude = _forward(base, input_ids, autocast=None)
    logits_bound = bf16_logits_bound(magnitude, args.layers)
    names = _kernel_names(accelerator)
    result: dict[str, Any] = {"cpu_fp32_loss": want_loss, "logits_magnitude": magnitude,
                              "logits_bound": logits_bound, "loss_bound": 2 * logits_bound, "runs": {}}
    variants = {"unfused": False, "fused": True} if names else {"unfused": False}
    for variant, switch in variants.items():
        model = copy.deepcopy(base).to(accelerator.device())
        applied = apply_kernels(model, accelerator.name, switch)
        got_logits, got_loss, _ = _forward(model, input_ids.to(accelerator.device()), accelerator.autocast_device_type)
        logits_diff = float((got_logits - want_logits).abs().max())
        # d(cross entropy)/d(logits) = softmax - one_hot has L1 norm <= 2: the loss moves <= 2 x the logits' max
        loss_diff = abs(got_loss - want_loss)
        result["runs"][variant] = {
            "kernels": dict(applied.counts), "npu_bf16_loss": got_loss, "loss_abs_diff": loss_diff,
            "logits_max_abs_diff": logits_diff,
            "passed": logits_diff <= logits_bound and loss_diff <= 2 * logits_bound}
        print(f"parity [{variant}] kernels={dict(applied.counts) or 'none'}: logits max|diff| {logits_diff:.3e} "
              f"(bound {logits_bound:.3e}), loss |diff| {loss_diff:.3e} (bound {2 * logits_bound:.3e}) -> "
              f"{'PASS' if result['runs'][variant]['passed'] else 'FAIL'}")
    result["passed"] = all(run["passed"] for run in result["runs"].values())
    return result


# ---------------------------------------------------------------------- (2) kernel speed-ups
def _median_ms(run: Callable[[], Any], accelerator: Any, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        accelerator.synchronize()
        start = time.perf_counter()
        run()
        accelerator.synchronize()  # the device queue, not just the launches
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def _train_pass(model: Any, input_ids: Any, autocast: str) -> Callable[[], float]:
    import torch

    def run() -> float:
        model.zero_grad(set_to_none=True)
        with torch.autocast(autocast, dtype=torch.bfloat16):
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return float(loss.detach())

    return run


def check_kernels(args: argparse.Namespace) -> dict[str, Any]:
    import math

    from twinkle_core.kernels import apply_kernels, optimizer_class

    accelerator = npu_accelerator()
    device, autocast = accelerator.device(), accelerator.autocast_device_type
    base, input_ids = tiny_qwen2(args), token_batch(args).to(device)
    names = _kernel_names(accelerator)

    def timed(keep: str | None) -> tuple[dict[str, int], float, float]:
        model = copy.deepcopy(base).to(device)  # a fresh copy: "model"-form kernels cannot be undone
        applied = apply_kernels(model, accelerator.name, _only(names, keep))
        run = _train_pass(model, input_ids, autocast)
        return dict(applied.counts), run(), _median_ms(run, accelerator, args.warmup, args.repeats)

    _, base_loss, base_ms = timed(None)
    print(f"kernels: unfused forward+backward {base_ms:.3f} ms (loss {base_loss:.4f})")
    rows: dict[str, Any] = {}
    for name in names:
        try:
            counts, loss, ms = timed(name)
        except Exception as exc:  # one broken kernel must not hide the others' numbers; it fails the check below
            rows[name] = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
            print(f"kernels: {name}: FAILED ({rows[name]['error']})")
            continue
        if not counts:
            rows[name] = {"sites": 0, "passed": True, "note": "not applicable to this model"}
            print(f"kernels: {name}: not applicable to this model")
            continue
        rows[name] = {"sites": counts[name], "fused_ms": ms, "speedup": base_ms / ms, "loss": loss,
                      "loss_abs_diff_vs_unfused": abs(loss - base_loss), "passed": math.isfinite(loss)}
        print(f"kernels: {name} ({counts[name]} sites): {ms:.3f} ms, speed-up x{base_ms / ms:.2f}")
    fused_adamw = optimizer_class("AdamW", accelerator.name)
    if fused_adamw is not None:
        rows["optimizer:AdamW"] = _optimizer_speedup(base, device, fused_adamw, accelerator, args)
    return {"unfused_ms": base_ms, "unfused_loss": base_loss, "kernels": rows,
            "passed": all(row["passed"] for row in rows.values())}


def _optimizer_speedup(base: Any, device: Any, fused: type, accelerator: Any, args: argparse.Namespace) -> dict:
    import torch

    timings = {}
    for label, cls in (("torch", torch.optim.AdamW), ("fused", fused)):
        params = [p.detach().clone().to(device).requires_grad_() for p in base.parameters()]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        optimizer = cls(params, lr=1e-3)
        timings[label] = _median_ms(optimizer.step, accelerator, args.warmup, args.repeats)
    print(f"kernels: optimizer AdamW -> {fused.__name__}: {timings['fused']:.3f} ms vs torch {timings['torch']:.3f} "
          f"ms, speed-up x{timings['torch'] / timings['fused']:.2f}")
    return {"class": fused.__name__, "torch_ms": timings["torch"], "fused_ms": timings["fused"],
            "speedup": timings["torch"] / timings["fused"], "passed": True}


# ---------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m twinkle_backend_npu.hardware_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=("parity", "kernels", "hccl", "versions"))
    parser.add_argument("--json", metavar="PATH", help="write the result here")
    sizes = parser.add_argument_group("model and batch (a tiny Qwen2 built from its config)")
    for flag, default in (("--hidden", 256), ("--layers", 2), ("--heads", 4), ("--vocab", 1024), ("--seq", 256),
                          ("--batch", 4), ("--warmup", 3), ("--repeats", 10)):
        sizes.add_argument(flag, type=int, default=default, help=f"(default {default})")
    parser.add_argument("--timeout", type=int, default=600, help="hccl: seconds before the 2-rank job is killed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found = versions()
    print("versions: " + ", ".join(f"{name} {value}" for name, value in found.items()))
    result: dict[str, Any] = {"check": args.check, "versions": found}
    try:
        if args.check == "parity":
            result.update(check_parity(args))
        elif args.check == "kernels":
            result.update(check_kernels(args))
        elif args.check == "hccl":
            from twinkle_backend_npu.hardware_check_hccl import check_hccl

            npu_accelerator()  # refuse here, with the reason, rather than in two ranks at once
            result.update(check_hccl(args))
        else:
            result["passed"] = True
        code = 0 if result["passed"] else 1
    except CannotRun as exc:
        result.update(passed=False, error=str(exc))
        print(f"{args.check}: cannot run here: {exc}", file=sys.stderr)
        code = 2
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    print(f"{args.check}: {'PASS' if code == 0 else 'FAIL'}")
    return code


if __name__ == "__main__":
    sys.exit(main())
