"""GPU check of quantisation: QLoRA on a CUDA GPU, and GPTQ / AWQ of a Twinkle export with llm-compressor.

Not run by the CPU test suite (it needs a CUDA GPU, and GPTQ / AWQ need ``pip install llmcompressor``, which
brings ``compressed-tensors`` for loading the result); ``--smoke`` runs the bitsandbytes parts on CPU with a tiny
model so the script does not rot (twinkle-backend-hf/tests/test_quantization.py runs it).

The model: a Qwen2 decoder with Qwen2.5-0.5B's layer shapes (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864) and the quickstart tokenizer's vocabulary (262 tokens: the calibration text is tokenised by it),
random weights, saved as a transformers directory with that tokenizer. No download.

Parts, each recorded in ``gpu_check_quantize.json`` with its status (``ok``, ``failed: ...`` or ``not run: ...``):

* ``qlora`` - ``TransformersModel(model_id=DIR, quantization={"bits": 4, "compute_dtype": "bfloat16"})`` with a
  LoRA adapter (r 16, all linear layers), ``--steps`` AdamW steps on one batch of random tokens: the loss of the
  first and last step (it must fall), the base layers' class, the peak CUDA memory, and the same for plain LoRA on
  the unquantised base (``lora_full_precision``), so the memory saving is measured, not assumed;
* ``export_4bit`` / ``export_8bit`` - ``twinkle_backend_hf.quantization.save_quantized`` of the base, reloaded by
  ``AutoModelForCausalLM.from_pretrained(DIR)`` alone, 8 tokens generated;
* ``gptq`` / ``awq`` - llm-compressor's ``oneshot`` with ``GPTQModifier`` / ``AWQModifier`` (scheme W4A16, the LM
  head left out) calibrated on ``--calibration-samples`` conversations of examples/quickstart/train.jsonl, saved
  compressed, reloaded by ``AutoModelForCausalLM.from_pretrained(DIR)`` and 8 tokens generated.

    python bench/gpu_check_quantize.py            # one CUDA GPU, about a minute
    python bench/gpu_check_quantize.py --smoke    # tiny model on CPU: qlora and the bitsandbytes exports only
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "examples" / "quickstart" / "tokenizer"
CALIBRATION = ROOT / "examples" / "quickstart" / "train.jsonl"
#: Qwen2.5-0.5B's layer shapes with the quickstart tokenizer's vocabulary
MODEL = {"model_type": "qwen2", "vocab_size": 262, "hidden_size": 896, "intermediate_size": 4864,
         "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
         "max_position_embeddings": 4096, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
         "pad_token_id": 0}
SMOKE_MODEL = {**MODEL, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2}
LORA = {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}
LLM_COMPRESSOR_HINT = "pip install llmcompressor (it brings compressed-tensors, which loads the result)"


def save_base(spec: dict[str, Any], directory: Path, seed: int) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**spec)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(directory)


def peak_memory(device: str) -> int | None:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device == "cuda" else None


def train_lora(base: Path, args: argparse.Namespace, quantization: dict[str, Any] | None) -> dict[str, Any]:
    """``args.steps`` LoRA steps on one batch; the loss of each step and where the memory went."""
    import torch
    from twinkle_backend_hf.model import TransformersModel

    if args.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    options = {"quantization": quantization} if quantization else {}
    model = TransformersModel(model_id=str(base), precision=args.precision, seed=args.seed, **options)
    model.add_adapter_to_model("default", dict(LORA))
    model.set_optimizer("AdamW", lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, MODEL["vocab_size"], (args.rows, args.seq_len), generator=generator)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    losses, started = [], time.perf_counter()
    for _ in range(args.steps):
        out = model.forward_backward(inputs=batch)
        model.clip_grad_and_step(1.0)
        losses.append(float(out["loss"]))
    seconds = time.perf_counter() - started
    layer = model.hf_model.model.layers[0].mlp.down_proj
    base_layer = getattr(layer, "base_layer", layer)
    result = {"losses": losses, "loss_falls": losses[-1] < losses[0], "seconds": round(seconds, 3),
              "base_layer": type(base_layer).__name__, "weight_dtype": str(base_layer.weight.dtype),
              "peak_memory_bytes": peak_memory(args.device)}
    del model
    return result


def export_bitsandbytes(base: Path, method: str, work: Path, device: str) -> dict[str, Any]:
    import torch
    import transformers
    from twinkle_backend_hf.quantization import save_quantized

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    output = work / f"export-{method}"
    save_quantized(model, str(output), method, max_shard_size="5GB")
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(output)  # as twinkle export writes it
    return generate_from(output, device) | {"config": json.loads((output / "config.json").read_text())
                                                       ["quantization_config"]["quant_method"]}


def generate_from(directory: Path, device: str) -> dict[str, Any]:
    """Load ``directory`` with nothing but transformers and greedily generate 8 tokens."""
    import torch
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, device_map=device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer("reverse: abc", return_tensors="pt").to(loaded.device)
    with torch.no_grad():
        out = loaded.generate(**prompt, max_new_tokens=8, do_sample=False)
    size = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    return {"generated_tokens": int(out.shape[1] - prompt["input_ids"].shape[1]), "weights_bytes": size,
            "layer": type(loaded.model.layers[0].mlp.down_proj).__name__}


def calibration_texts(tokenizer: Any, count: int) -> list[str]:
    texts = []
    with open(CALIBRATION) as fh:
        for line in fh:
            texts.append(tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False))
            if len(texts) == count:
                break
    return texts


def export_llm_compressor(base: Path, method: str, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """GPTQ or AWQ (W4A16) with llm-compressor's ``oneshot``, saved compressed, reloaded and generated from."""
    import datasets
    import torch
    import transformers
    from llmcompressor import oneshot

    if method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier as Modifier
    else:
        from llmcompressor.modifiers.awq import AWQModifier as Modifier
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, device_map="cuda")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    data = datasets.Dataset.from_dict({"text": calibration_texts(tokenizer, args.calibration_samples)})
    data = data.map(lambda row: tokenizer(row["text"], add_special_tokens=False), remove_columns=["text"])
    started = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=[Modifier(targets="Linear", scheme="W4A16", ignore=["lm_head"])],
            max_seq_length=256, num_calibration_samples=args.calibration_samples)
    seconds = time.perf_counter() - started
    output = work / f"export-{method}"
    model.save_pretrained(output, save_compressed=True)
    tokenizer.save_pretrained(output)
    return generate_from(output, "cuda") | {"quantize_seconds": round(seconds, 3)}


def run_part(results: dict[str, Any], name: str, needs: str | None, action: Any) -> None:
    """``results[name]``: the part's measurements with status ok, or why it failed or did not run."""
    if needs:
        results[name] = {"status": f"not run: {needs}"}
        return
    try:
        results[name] = {"status": "ok", **action()}
    except Exception as exc:  # recorded, and the other parts still run: the JSON says which failed and why
        results[name] = {"status": f"failed: {type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU: qlora and bitsandbytes exports")
    parser.add_argument("--steps", type=int, default=None, help="LoRA steps per run (default 20, smoke 4)")
    parser.add_argument("--rows", type=int, default=None, help="rows per batch (default 8, smoke 2)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 1024, smoke 32)")
    parser.add_argument("--calibration-samples", type=int, default=64, help="GPTQ / AWQ calibration conversations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=None, help="where the JSON goes (default bench/results)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        C.set_threads(1)
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import importlib.util

    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and args.device != "cuda":
        sys.exit("bench/gpu_check_quantize.py needs a CUDA GPU (use --smoke for the tiny CPU run)")
    args.steps = args.steps or (4 if args.smoke else 20)
    args.rows = args.rows or (2 if args.smoke else 8)
    args.seq_len = args.seq_len or (32 if args.smoke else 1024)
    args.precision = "no" if args.smoke else "bf16"
    spec = SMOKE_MODEL if args.smoke else MODEL
    no_gpu = "needs a CUDA GPU" if args.device != "cuda" else None
    no_library = None if importlib.util.find_spec("llmcompressor") else LLM_COMPRESSOR_HINT
    compute = "float32" if args.smoke else "bfloat16"
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="twinkle-gpu-quantize-") as tmp:
        work = Path(tmp)
        save_base(spec, work / "base", args.seed)
        run_part(results, "qlora", None,
                 lambda: train_lora(work / "base", args, {"bits": 4, "compute_dtype": compute}))
        run_part(results, "lora_full_precision", None, lambda: train_lora(work / "base", args, None))
        for method in ("4bit", "8bit"):
            run_part(results, f"export_{method}", None,
                     lambda method=method: export_bitsandbytes(work / "base", method, work, args.device))
        for method in ("gptq", "awq"):
            run_part(results, method, no_gpu or no_library,
                     lambda method=method: export_llm_compressor(work / "base", method, work, args))
    qlora, full = results["qlora"], results["lora_full_precision"]
    if qlora.get("peak_memory_bytes") and full.get("peak_memory_bytes"):
        results["qlora_peak_memory_over_lora"] = qlora["peak_memory_bytes"] / full["peak_memory_bytes"]
    payload = {"settings": {"smoke": args.smoke, "device": args.device, "model": spec, "lora": LORA,
                            "steps": args.steps, "rows": args.rows, "seq_len": args.seq_len,
                            "precision": args.precision,
                            "device_name": torch.cuda.get_device_name() if args.device == "cuda" else None},
               "runs": results}
    try:
        import bitsandbytes

        payload["settings"]["bitsandbytes"] = bitsandbytes.__version__
    except ImportError:
        payload["settings"]["bitsandbytes"] = None
    path = C.write_result("gpu_check_quantize", payload, out_dir=args.out_dir)
    for name, run in results.items():
        status = run.get("status", run) if isinstance(run, dict) else run
        print(f"{name}: {status}")
    print(f"wrote {path}")
    failed = [name for name, run in results.items() if isinstance(run, dict) and
              str(run.get("status", "")).startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
