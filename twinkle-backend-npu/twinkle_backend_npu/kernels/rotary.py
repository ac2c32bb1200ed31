"""``npu_rotary_mul`` in place of a modeling module's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.

Hugging Face rotates as ``q * cos + rotate_half(q) * sin`` with ``cos``/``sin`` unsqueezed at the heads dim;
``npu_rotary_mul(x, r1, r2)`` in its default ``rotary_mode="half"`` is exactly that. The core swaps the module-level
function for the modules of one network only, and back (:mod:`twinkle_core.kernels`, ``function:`` targets).
"""

from __future__ import annotations

from typing import Any


def apply_rotary_pos_emb(q: Any, k: Any, cos: Any, sin: Any, unsqueeze_dim: int = 1) -> tuple[Any, Any]:
    if cos.shape[-1] != q.shape[-1]:
        raise ValueError(f"npu_rotary_mul rotates the whole head dim ({q.shape[-1]}), but cos/sin cover "
                         f"{cos.shape[-1]} (partial rotary); turn the kernel off with model.options.kernels: "
                         f"{{npu_rotary_mul: false}}")
    import torch_npu

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return torch_npu.npu_rotary_mul(q, cos, sin), torch_npu.npu_rotary_mul(k, cos, sin)
