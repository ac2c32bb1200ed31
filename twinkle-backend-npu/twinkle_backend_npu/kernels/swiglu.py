"""``npu_swiglu`` in place of the gated MLP ``forward`` ``down(silu(gate(x)) * up(x))`` of the supported families.

``npu_swiglu(t, dim=-1)`` splits ``t`` in halves ``a, b`` and returns ``silu(a) * b`` (forward and backward in one
kernel), so the gate and up projections are concatenated in that order. The weights stay separate, so checkpoints
keep Hugging Face's layout. A module whose activation is not SiLU keeps its own ``forward``.

Qwen3-MoE's routed experts are left to transformers' experts implementation (``grouped_mm`` by default); its
dense ``Qwen3MoeMLP`` layers use this kernel.
"""

from __future__ import annotations

from typing import Any


def forward(self: Any, x: Any) -> Any:
    import torch
    from transformers.activations import SiLUActivation

    if not isinstance(self.act_fn, (SiLUActivation, torch.nn.SiLU)):
        return type(self).forward(self, x)
    import torch_npu

    gate_up = torch.cat((self.gate_proj(x), self.up_proj(x)), dim=-1)
    return self.down_proj(torch_npu.npu_swiglu(gate_up, dim=-1))
