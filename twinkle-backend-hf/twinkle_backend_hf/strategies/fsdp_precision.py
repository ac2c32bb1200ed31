"""FSDP2's mixed-precision policy, derived from the model's precision (the one owner of precision).

The precision's compute dtype reaches every forward through the strategy's ``forward_context`` (autocast), so
FSDP2 gathers the sharded weights as they are stored (fp32) and reduces fp32 gradients, whatever the precision:
``MixedPrecisionPolicy()``, which is what ``native_fsdp`` has always run. ``strategy_options.mixed_precision``
may go further and gather the weights (and compute their gradients) in a lower dtype, still reduced in fp32:
``"bf16"`` / ``"fp16"`` or a ``MixedPrecisionPolicy``. That lower dtype must be the precision's own; a policy
that contradicts the precision (``precision="no"`` with bf16 weights, ``precision="bf16"`` with fp16) is a
:class:`~twinkle_core.errors.ConfigError` naming both settings, never a silent mix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from twinkle_core.errors import ConfigError

if TYPE_CHECKING:
    from twinkle_core.precision import Precision

#: the names ``mixed_precision`` accepts for a lower dtype
LOWER_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
#: the names that keep FSDP2's default policy (weights as stored, fp32 reductions)
DEFAULT_POLICY = (None, "no")


def requested_dtypes(option: Any) -> list[torch.dtype]:
    """The floating dtypes narrower than fp32 that the ``mixed_precision`` option asks FSDP2 for."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if option in DEFAULT_POLICY:
        return []
    if isinstance(option, MixedPrecisionPolicy):
        dtypes = (option.param_dtype, option.reduce_dtype, option.output_dtype)
        return [d for d in dtypes if d is not None and d.is_floating_point and d.itemsize < 4]
    if isinstance(option, str) and option in LOWER_DTYPES:
        return [LOWER_DTYPES[option]]
    raise ConfigError(f"native_fsdp mixed_precision must be 'bf16', 'fp16', 'no' or a MixedPrecisionPolicy, "
                      f"got {option!r}")


def check_mixed_precision(precision: Precision | None, option: Any) -> None:
    """Refuse a ``mixed_precision`` option that is unknown or contradicts ``precision`` (``None``: not bound yet,
    only the option's form is checked)."""
    dtypes = requested_dtypes(option)
    if precision is None or not dtypes:
        return
    compute = precision.autocast_dtype
    for dtype in dtypes:
        if compute is None or dtype != getattr(torch, compute):
            computes = f"computes in {compute}" if compute else "trains in fp32"
            raise ConfigError(f"strategy_options.mixed_precision={_describe(option)} asks FSDP2 for {dtype}, which "
                              f"contradicts precision={precision.name!r} (it {computes}); set the model's precision "
                              f"instead, or a mixed_precision that matches it")


def mixed_precision_policy(precision: Precision | None, option: Any) -> Any:
    """The ``MixedPrecisionPolicy`` ``fully_shard`` gets for ``precision`` and the ``mixed_precision`` option."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    check_mixed_precision(precision, option)
    if option in DEFAULT_POLICY:
        return MixedPrecisionPolicy()
    if isinstance(option, MixedPrecisionPolicy):
        return option
    return MixedPrecisionPolicy(param_dtype=LOWER_DTYPES[option], reduce_dtype=torch.float32)


def _describe(option: Any) -> str:
    return repr(option) if isinstance(option, str) else type(option).__name__
