"""``npu_rms_norm`` in place of the RMSNorm ``forward`` of the supported families.

Hugging Face computes ``weight * (x * rsqrt(mean(x^2) + eps))`` in float32 and casts back; ``torch_npu.npu_rms_norm``
does the same in one kernel (and saves ``rstd`` for its fused backward). The fused op needs ``weight`` in the dtype
of its input; when they differ (fp32 weights under autocast) the module's own ``forward`` runs, so the result and
its dtype never change.
"""

from __future__ import annotations

from typing import Any


def forward(self: Any, hidden_states: Any) -> Any:
    if hidden_states.dtype != self.weight.dtype:
        return type(self).forward(self, hidden_states)
    import torch_npu

    return torch_npu.npu_rms_norm(hidden_states, self.weight, epsilon=self.variance_epsilon)[0]
