"""QLoRA: a base model loaded 4-bit (or 8-bit) with bitsandbytes, LoRA adapters trained on top.

``TransformersModel(model_id=..., quantization={"bits": 4})`` (recipe: ``model.options.quantization``) loads the
base through ``transformers.BitsAndBytesConfig``: its linear layers become ``bitsandbytes`` ``Linear4bit`` /
``Linear8bitLt`` and stay frozen; only adapters train. The aliases other tools' users write are accepted:
``load_in_4bit: true`` / ``load_in_8bit: true`` (transformers) and ``quantization_bit: 4`` (LLaMA-Factory).
An adapter saved from such a model is a plain PEFT adapter whose recorded base is the unquantised directory, so
``twinkle export --merge-lora`` merges it into full-precision weights.

Refused, with what is needed: quantisation without an adapter (full fine-tuning of a quantised base), a strategy
that shards parameters (FSDP2, Accelerate FSDP, DeepSpeed ZeRO-3), fp8 precision, a model built from a config
alone (nothing to quantise), bitsandbytes missing, and a bitsandbytes whose kernels do not run on this device.
``twinkle export --quantize`` (:func:`check_export`, :func:`save_quantized`) writes a bitsandbytes-quantised copy.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from twinkle_core.errors import ConfigError

#: the first bitsandbytes release with kernels for devices other than CUDA (torch implementations that run on CPU)
MIN_CPU_BITSANDBYTES = (0, 46)
INSTALL_HINT = "pip install bitsandbytes (or pip install 'twinkle-backend-hf[quantize]')"
QUANT_TYPES = ("nf4", "fp4")
#: torch dtype names (this module imports torch only where it runs: ``twinkle export --help`` imports it)
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
#: the keys of ``model.options.quantization`` as a mapping
OPTION_KEYS = ("bits", "quant_type", "compute_dtype", "double_quant")
#: strategies that keep every parameter whole on each rank (the quantised weights are not sharded); DeepSpeed
#: is allowed below ZeRO stage 3
STRATEGIES = ("single", "ddp", "grad_allreduce", "ulysses", "deepspeed")
#: ``twinkle export --quantize`` methods: bitsandbytes here, the others through their own libraries on a GPU
EXPORT_METHODS = ("4bit", "8bit", "gptq", "awq")
GPU_EXPORT_LIBRARIES = {"gptq": "gptqmodel (pip install gptqmodel) or llm-compressor (pip install llmcompressor)",
                        "awq": "autoawq (pip install autoawq) or llm-compressor (pip install llmcompressor)"}
GPU_CHECK_SCRIPT = "bench/gpu_check_quantize.py"


@dataclasses.dataclass(frozen=True)
class QuantizationSettings:
    """How the base is quantised: ``bits`` 4 (``quant_type`` nf4 or fp4, optionally ``double_quant``) or 8;
    ``compute_dtype`` is the dtype 4-bit layers dequantise to for their matmuls."""

    bits: int
    quant_type: str = "nf4"
    compute_dtype: str = "float32"
    double_quant: bool = False

    def bnb_config(self) -> Any:
        import torch
        from transformers import BitsAndBytesConfig

        if self.bits == 8:
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.quant_type,
                                  bnb_4bit_compute_dtype=getattr(torch, self.compute_dtype),
                                  bnb_4bit_use_double_quant=self.double_quant)

    def describe(self) -> dict[str, Any]:
        if self.bits == 8:
            return {"bits": 8, "library": "bitsandbytes"}
        return {"library": "bitsandbytes", **dataclasses.asdict(self)}


def settings_from_options(quantization: Any = None, *, load_in_4bit: bool = False, load_in_8bit: bool = False,
                          quantization_bit: int | None = None) -> QuantizationSettings | None:
    """The settings the model options ask for (``None``: no quantisation). ``quantization`` is 4, 8, "4bit",
    "8bit" or a mapping with :data:`OPTION_KEYS`; the aliases must agree with it and with each other."""
    asked: dict[str, int] = {}
    settings = None
    if quantization is not None and quantization is not False:
        settings = _parse(quantization)
        asked["quantization"] = settings.bits
    for name, value in (("load_in_4bit", load_in_4bit), ("load_in_8bit", load_in_8bit)):
        if not isinstance(value, bool):
            raise ConfigError(f"model.options.{name} must be true or false, got {value!r}")
        if value:
            asked[name] = 4 if name == "load_in_4bit" else 8
    if quantization_bit is not None:
        if quantization_bit not in (4, 8) or isinstance(quantization_bit, bool):
            raise ConfigError(f"model.options.quantization_bit must be 4 or 8 (bitsandbytes), got {quantization_bit!r}")
        asked["quantization_bit"] = quantization_bit
    if len(set(asked.values())) > 1:
        given = ", ".join(f"{name} ({bits}-bit)" for name, bits in asked.items())
        raise ConfigError(f"model.options ask for different quantisations: {given}; keep one of them")
    if settings is None and asked:
        settings = QuantizationSettings(bits=next(iter(asked.values())))
    return settings


#: the model options that ask for quantisation (``quantization`` and its aliases)
MODEL_OPTIONS = ("quantization", "load_in_4bit", "load_in_8bit", "quantization_bit")


def check_model_options(options: Mapping[str, Any]) -> None:
    """What ``twinkle train`` / ``--dry-run`` can check from ``model.options`` alone, before anything is built: the
    settings, a clash with ``model_kwargs.quantization_config``, and that bitsandbytes is installed and runs here
    (the strategy, the adapter and the model source are checked when the model is built)."""
    settings = settings_from_options(**{key: options[key] for key in MODEL_OPTIONS if key in options})
    if settings is None:
        return
    from twinkle_core.accelerator import current_accelerator

    check_model_kwargs(options.get("model_kwargs") or {})
    check_device(current_accelerator().device_type, settings.bits, settings.quant_type)


def _parse(value: Any) -> QuantizationSettings:
    if isinstance(value, str) and value.lower() in ("4bit", "8bit"):
        value = int(value[0])
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"bits": value}
    if value is True:
        raise ConfigError("model.options.quantization: true does not say how many bits; write quantization: "
                          "{bits: 4} (or 8)")
    if not isinstance(value, Mapping):
        raise ConfigError(f"model.options.quantization must be 4, 8 or a mapping such as {{bits: 4, quant_type: nf4, "
                          f"compute_dtype: bfloat16}}, got {value!r}")
    unknown = sorted(set(value) - set(OPTION_KEYS))
    if unknown:
        raise ConfigError(f"model.options.quantization got unknown key(s) {', '.join(map(str, unknown))}; known: "
                          f"{', '.join(OPTION_KEYS)}")
    bits = value.get("bits")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise ConfigError(f"model.options.quantization.bits must be 4 or 8 (bitsandbytes), got {bits!r}")
    quant_type = value.get("quant_type", "nf4")
    if quant_type not in QUANT_TYPES:
        raise ConfigError(f"model.options.quantization.quant_type must be one of {', '.join(QUANT_TYPES)}, got "
                          f"{quant_type!r}")
    compute_dtype = value.get("compute_dtype", "float32")
    if compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"model.options.quantization.compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                          f"got {compute_dtype!r}")
    double_quant = value.get("double_quant", False)
    if not isinstance(double_quant, bool):
        raise ConfigError(f"model.options.quantization.double_quant must be true or false, got {double_quant!r}")
    if bits == 8 and any(key in value for key in ("quant_type", "compute_dtype", "double_quant")):
        raise ConfigError("model.options.quantization: quant_type, compute_dtype and double_quant apply to 4-bit "
                          "only; remove them for bits: 8")
    return QuantizationSettings(bits=bits, quant_type=quant_type, compute_dtype=compute_dtype,
                                double_quant=double_quant)


# ---------------------------------------------------------------------- what this machine can run
def bitsandbytes_version() -> str:
    """The installed bitsandbytes version; a :class:`ConfigError` naming the install command without it."""
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ConfigError(f"quantisation needs bitsandbytes, which is not installed ({exc}): {INSTALL_HINT}") from None
    return str(bitsandbytes.__version__)


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_device(device: Any, bits: int, quant_type: str = "nf4") -> None:
    """Refuse, naming the bitsandbytes version and what is needed, a device its ``bits``-bit kernels do not run
    on. CUDA is bitsandbytes' own device; elsewhere a 64x64 layer is quantised and run once (cached per process)."""
    import torch

    version = bitsandbytes_version()
    kind = torch.device(device).type
    if kind == "cuda":
        return
    if _release(version) < MIN_CPU_BITSANDBYTES:
        raise ConfigError(f"bitsandbytes {version} runs {bits}-bit layers on CUDA only and this model runs on "
                          f"{kind}: use a CUDA GPU, or upgrade to bitsandbytes>="
                          f"{'.'.join(map(str, MIN_CPU_BITSANDBYTES))} (pip install -U bitsandbytes), whose torch "
                          f"kernels run on CPU")
    problem = kernel_problem(kind, bits, quant_type)
    if problem:
        raise ConfigError(f"bitsandbytes {version} cannot run {bits}-bit layers on {kind} ({problem}): use a CUDA "
                          f"GPU, or a bitsandbytes release with a {kind} backend")


@functools.cache
def kernel_problem(kind: str, bits: int, quant_type: str = "nf4") -> str | None:
    """None when one small quantised layer runs forward and backward on ``kind``; else the library's error."""
    import bitsandbytes as bnb
    import torch

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 64, generator=generator)
    x = torch.randn(2, 64, generator=generator, requires_grad=True)
    try:
        if bits == 4:
            layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type=quant_type)
            layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type=quant_type)
        else:
            layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
        layer = layer.to(kind)
        layer(x.to(kind)).sum().backward()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError) as exc:  # what a missing kernel raises
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------------- combinations that cannot work
def check_source(model_id: str | None) -> None:
    if model_id is None:
        raise ConfigError("model.options.quantization quantises weights as they are loaded, and a model built from "
                          "model.config alone has none to load: save the model first (save_pretrained, or a Twinkle "
                          "full checkpoint) and set model.model_id to that directory")


def check_strategy(strategy: Any, precision: Any) -> None:
    name = getattr(strategy, "name", type(strategy).__name__)
    if name not in STRATEGIES or (name == "deepspeed" and getattr(strategy, "stage", None) == 3):
        what = "DeepSpeed ZeRO-3" if name == "deepspeed" else repr(name)
        raise ConfigError(f"model.options.quantization cannot run under strategy {what}: it shards parameters, and "
                          f"bitsandbytes' quantised weights cannot be sharded; use one of "
                          f"{', '.join(s for s in STRATEGIES if s != 'deepspeed')} or deepspeed with stage 1 or 2")
    if getattr(precision, "name", None) == "fp8":
        raise ConfigError("model.options.quantization cannot run with precision fp8 (both replace the linear layers); "
                          "use precision bf16 (or no)")


def check_model_kwargs(model_kwargs: Mapping[str, Any]) -> None:
    if "quantization_config" in model_kwargs:
        raise ConfigError("model.options.quantization and model_kwargs.quantization_config both quantise the model; "
                          "keep one of them")


FULL_FINE_TUNING_REFUSAL = ("this model's base is quantised (model.options.quantization or a quantised model "
                            "directory), so its weights cannot be trained: add a LoRA adapter (model.adapter, or "
                            "add_adapter_to_model) and train that (QLoRA), or drop the quantisation for full "
                            "fine-tuning")


def is_quantized(network: Any) -> bool:
    """Whether transformers loaded ``network`` quantised (by our options or from a quantised directory)."""
    return getattr(network, "hf_quantizer", None) is not None


# ---------------------------------------------------------------------- loading
def load_kwargs(settings: QuantizationSettings, device: Any) -> dict[str, Any]:
    """``from_pretrained`` arguments: the bitsandbytes config, and the device the layers are quantised on (a
    quantised layer is quantised where it is placed, so it is placed once, on the device it trains on)."""
    import torch

    return {"quantization_config": settings.bnb_config(), "device_map": {"": str(torch.device(device))}}


def prepare_for_training(network: Any) -> Any:
    """PEFT's preparation of a quantised base: every base weight frozen, layer norms kept in float32, inputs
    that require grad (so that gradient checkpointing reaches the adapters). Checkpointing itself is left to
    ``gradient_checkpointing``."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(network, use_gradient_checkpointing=False)


# ---------------------------------------------------------------------- twinkle export --quantize
def check_export(method: str | None, *, full_model: bool) -> None:
    """Refuse ``--quantize METHOD`` before anything loads: an unmerged adapter, GPTQ / AWQ without CUDA (naming
    their libraries and the GPU check script), bitsandbytes missing or unable to run here."""
    if method is None:
        return
    from twinkle_core.accelerator import current_accelerator

    if method not in EXPORT_METHODS:
        raise ConfigError(f"--quantize {method!r}: choose one of {', '.join(EXPORT_METHODS)}")
    if not full_model:
        raise ConfigError(f"--quantize {method} quantises a full model; this checkpoint is a LoRA adapter: add "
                          f"--merge-lora (the adapter is merged into its base first, then quantised)")
    if method in GPU_EXPORT_LIBRARIES:
        if current_accelerator().device_type != "cuda":
            raise ConfigError(f"--quantize {method} calibrates on a CUDA GPU and this machine has none: run it on a "
                              f"GPU machine with {GPU_EXPORT_LIBRARIES[method]}; {GPU_CHECK_SCRIPT} checks that path")
        raise ConfigError(f"--quantize {method} is not built into twinkle export: quantise the exported model with "
                          f"{GPU_EXPORT_LIBRARIES[method]} (as {GPU_CHECK_SCRIPT} does), or use --quantize 4bit / "
                          f"8bit (bitsandbytes)")
    check_device(current_accelerator().device_type, int(method[0]))


def save_quantized(model: Any, output: str, method: str, *, max_shard_size: Any) -> None:
    """Write ``model`` (a full transformers model) to ``output`` quantised by bitsandbytes (``method`` 4bit or
    8bit): saved whole to a temporary directory, loaded back through ``BitsAndBytesConfig`` (its config then
    carries the ``quantization_config`` that ``from_pretrained`` reads) and saved again."""
    import torch
    from transformers import AutoModelForCausalLM

    from twinkle_core.accelerator import current_accelerator

    dtype = next(model.parameters()).dtype
    compute = next((name for name in COMPUTE_DTYPES if getattr(torch, name) == dtype), "float32")
    settings = QuantizationSettings(bits=8) if method == "8bit" else QuantizationSettings(bits=4, compute_dtype=compute)
    device = current_accelerator().device()
    with tempfile.TemporaryDirectory(prefix="twinkle-quantize-") as full:
        model.save_pretrained(full, safe_serialization=True)
        quantised = AutoModelForCausalLM.from_pretrained(full, dtype=dtype, **load_kwargs(settings, device))
        quantised.config.use_cache = True
        quantised.save_pretrained(os.fspath(output), max_shard_size=max_shard_size, safe_serialization=True)
