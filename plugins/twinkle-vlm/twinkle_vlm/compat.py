"""Let image-only processors load when torchvision is not installed.

transformers 5.24 gives Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL processors a ``video_processor``
sub-processor. Its classes need torchvision, and without torchvision two things break even for
image-only use:

* ``ProcessorMixin.__init__`` type-checks every sub-processor against ``VideoProcessorMixin``, a name
  that transformers only exports when torchvision is installed, and rejects ``None``;
* ``AutoProcessor.from_pretrained`` calls ``AutoVideoProcessor.from_pretrained``, which raises;
* ``ProcessorMixin.save_pretrained`` reads ``_auto_class`` of every sub-processor.

:func:`allow_processors_without_torchvision` makes all three accept a missing video processor (``None``):
images and text process exactly as before, passing ``videos=`` fails inside the processor. It changes
nothing when torchvision is installed, and is idempotent.
"""

from __future__ import annotations

import importlib
from typing import Any

_PATCHED = False


class _Absent:
    """Stands for a missing sub-processor while ``save_pretrained`` runs (it has nothing to save)."""

    _auto_class = None

    def __deepcopy__(self, memo: dict) -> _Absent:
        return self


_ABSENT = _Absent()


class _NoVideoProcessor:
    """Stands in for ``AutoVideoProcessor`` without torchvision: every video processor class needs
    torchvision, so loading one yields ``None`` (the processor then handles images and text only)."""

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> None:
        return None


def allow_processors_without_torchvision() -> None:
    """Patch transformers (only when torchvision is missing) so video-capable processors load
    image-only. Call before building or loading a processor; safe to call many times."""
    global _PATCHED
    if _PATCHED:
        return
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        _PATCHED = True
        return
    from transformers.processing_utils import ProcessorMixin

    # the module itself: ``from transformers.models.auto import video_processing_auto`` yields a lazy placeholder
    video_processing_auto = importlib.import_module("transformers.models.auto.video_processing_auto")

    original_check = ProcessorMixin.check_argument_for_proper_class

    def check_argument_for_proper_class(self: Any, argument_name: str, argument: Any) -> Any:
        # a video processor cannot exist without torchvision: accept its absence
        if argument is None and "video" in argument_name:
            return None
        return original_check(self, argument_name, argument)

    original_save = ProcessorMixin.save_pretrained
    original_to_dict = ProcessorMixin.to_dict

    def save_pretrained(self: Any, *args: Any, **kwargs: Any) -> Any:
        absent = [name for name in self.get_attributes() if getattr(self, name, None) is None]
        for name in absent:
            setattr(self, name, _ABSENT)
        try:
            return original_save(self, *args, **kwargs)
        finally:
            for name in absent:
                setattr(self, name, None)

    def to_dict(self: Any) -> dict[str, Any]:
        # an absent sub-processor is not written, so a torchvision install loads its default one
        subprocessors = set(self.get_attributes())
        return {k: v for k, v in original_to_dict(self).items()
                if not (k in subprocessors and (v is None or v is _ABSENT))}

    ProcessorMixin.check_argument_for_proper_class = check_argument_for_proper_class
    ProcessorMixin.save_pretrained = save_pretrained
    ProcessorMixin.to_dict = to_dict
    # ``AutoProcessor`` resolves this name lazily from the module; without torchvision it is a dummy
    # that raises on any attribute access
    video_processing_auto.AutoVideoProcessor = _NoVideoProcessor
    _PATCHED = True


__all__ = ["allow_processors_without_torchvision"]
