"""The Ascend fused kernels, registered through the core's kernel registry (:mod:`twinkle_core.kernels`).

They apply on the ``npu`` accelerator only, to Qwen2 / Qwen2.5 (model type ``qwen2``), Qwen3, Qwen3-MoE, Llama and
Mistral; a recipe turns one off with ``model.options.kernels: {npu_swiglu: false}`` (all: ``kernels: false``).

==============================  ===============================================  =====================================
kernel                          replaces                                         torch_npu op
==============================  ===============================================  =====================================
``npu_rms_norm``                ``<Family>RMSNorm.forward``                      ``npu_rms_norm``
``npu_rotary_mul``              ``modeling_<family>.apply_rotary_pos_emb``       ``npu_rotary_mul``
``npu_swiglu``                  ``<Family>MLP.forward``                          ``npu_swiglu``
``npu_fusion_attention``        the network's attention implementation           ``npu_fusion_attention`` (TND)
``npu_ring_block_attention``    ring attention's full and causal blocks          ``npu_fusion_attention`` (BNSD)
``npu_fused_adamw``             ``set_optimizer("AdamW")``                       ``torch_npu.optim.NpuFusedAdamW``
==============================  ===============================================  =====================================
"""

from __future__ import annotations

from collections.abc import Iterator

from twinkle_core.records import KernelRecord

#: transformers model type -> the class-name prefix of its modeling module
FAMILIES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "llama": "Llama", "mistral": "Mistral"}
ACCELERATORS = ("npu",)
_PKG = "twinkle_backend_npu.kernels"


def _targets(form: str, name: str) -> tuple[str, ...]:
    """``form:`` targets naming ``name`` (``{prefix}`` is the family's class prefix) in each family's modeling module."""
    return tuple(f"{form}:transformers.models.{family}.modeling_{family}:{name.format(prefix=prefix)}"
                 for family, prefix in FAMILIES.items())


def kernel_records() -> Iterator[KernelRecord]:
    yield KernelRecord("npu_rms_norm", f"{_PKG}.rms_norm:forward", "RMSNorm as torch_npu.npu_rms_norm",
                       accelerators=ACCELERATORS, replaces=_targets("module", "{prefix}RMSNorm"))
    yield KernelRecord("npu_rotary_mul", f"{_PKG}.rotary:apply_rotary_pos_emb", "rotary embedding as npu_rotary_mul",
                       accelerators=ACCELERATORS, replaces=_targets("function", "apply_rotary_pos_emb"))
    yield KernelRecord("npu_swiglu", f"{_PKG}.swiglu:forward", "gated SiLU MLP as torch_npu.npu_swiglu",
                       accelerators=ACCELERATORS, replaces=_targets("module", "{prefix}MLP"))
    yield KernelRecord("npu_fusion_attention", f"{_PKG}.attention:apply",
                       "attention as npu_fusion_attention (TND, packed sequences)", accelerators=ACCELERATORS,
                       replaces=("model",))
    yield KernelRecord("npu_ring_block_attention", f"{_PKG}.ring_block:apply",
                       "ring attention's full and causal blocks as npu_fusion_attention", accelerators=ACCELERATORS,
                       replaces=("model",))
    yield KernelRecord("npu_fused_adamw", "torch_npu.optim:NpuFusedAdamW", "set_optimizer('AdamW') as NpuFusedAdamW",
                       accelerators=ACCELERATORS, replaces=("optimizer:AdamW",))
