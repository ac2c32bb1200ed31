"""Keep accelerate from importing DeepSpeed while saving a model in a process that does not use DeepSpeed.

``PreTrainedModel.save_pretrained`` unwraps the model with accelerate's ``extract_model_from_parallel``, which,
whenever DeepSpeed is installed, imports it to ask ``isinstance(model, DeepSpeedEngine)``. In a run without
DeepSpeed that import took 4.5 s at the first save (2-core CPU machine) and printed DeepSpeed's accelerator
detection, "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.", from
every process that saves. No model can be a ``DeepSpeedEngine`` before ``deepspeed`` is imported, so
:func:`unwrap_without_importing_deepspeed` makes accelerate's check (``accelerate.utils.other.is_deepspeed_available``)
also ask whether it is: under the ``deepspeed`` strategy (which imports it first) nothing changes.
"""

from __future__ import annotations

import sys


def unwrap_without_importing_deepspeed() -> bool:
    """Make accelerate's unwrapping check for DeepSpeed engines only once ``deepspeed`` is imported; idempotent.
    False when this accelerate has no such check (nothing to change)."""
    from accelerate.utils import other

    installed = getattr(other, "is_deepspeed_available", None)
    if installed is None:
        return False
    if getattr(installed, "_twinkle_needs_import", False):
        return True

    def is_deepspeed_available() -> bool:
        return "deepspeed" in sys.modules and installed()

    is_deepspeed_available._twinkle_needs_import = True  # type: ignore[attr-defined]
    other.is_deepspeed_available = is_deepspeed_available
    return True


__all__ = ["unwrap_without_importing_deepspeed"]
