"""Megatron on Ascend NPUs: MindSpeed's adaptor patches megatron-core before anything imports it.

megatron-core calls ``torch.cuda`` and Transformer Engine / Apex kernels directly. On Ascend, MindSpeed
(``mindspeed.megatron_adaptor``) replaces them with ``torch_npu`` equivalents by patching megatron-core's
modules *as they are imported*. Whatever was bound before the adaptor ran (``from megatron.core import
tensor_parallel`` in some module) keeps the CUDA version, so the adaptor must be the first import: a
megatron-core already in ``sys.modules`` is refused rather than trained half-patched.

:func:`prepare_megatron` is the one call the backend makes, at the start of
``MegatronStrategy.setup`` (before its first megatron-core import). On any accelerator other than ``npu``
it does nothing, and on ``npu`` the strategy takes its device and collective backend (``hccl``) from the
accelerator like everywhere else.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from twinkle_core.errors import UnsupportedHardwareError

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator

__all__ = ["ADAPTOR", "prepare_megatron"]

ADAPTOR = "mindspeed.megatron_adaptor"
#: MindSpeed is installed from source, one branch per megatron-core release; this page has the table
VERSION_TABLE = "https://gitcode.com/Ascend/MindSpeed/blob/master/docs/user-guide/installation.md"


def _megatron_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("megatron-core")
    except PackageNotFoundError:
        return "not installed"


def _imported_megatron_core() -> list[str]:
    return sorted(name for name in sys.modules if name == "megatron.core" or name.startswith("megatron.core."))


def prepare_megatron(accelerator: Accelerator) -> bool:
    """Import MindSpeed's adaptor when training on ``npu``; ``True`` when it is active, ``False`` elsewhere."""
    # by name: under the CPU fake of torch_npu the npu accelerator's tensors (device_type) live on the CPU
    if accelerator.name != "npu":
        return False
    if ADAPTOR in sys.modules:
        return True  # patched already (an earlier model in this process, or the user's own script)
    early = _imported_megatron_core()
    if early:
        raise UnsupportedHardwareError(
            f"Megatron on Ascend NPU: megatron-core was imported before MindSpeed could patch it ({', '.join(early[:3])}"
            f"{' ...' if len(early) > 3 else ''} already loaded), so it would still call CUDA. Import "
            f"'{ADAPTOR}' first: put `import {ADAPTOR}` at the top of your script, before anything that imports "
            f"megatron.core")
    try:
        importlib.import_module(ADAPTOR)
    except ModuleNotFoundError as exc:
        if exc.name not in ("mindspeed", ADAPTOR):
            raise  # MindSpeed is there but one of its own dependencies is not: its message names which
        raise UnsupportedHardwareError(
            f"Megatron on Ascend NPU needs MindSpeed, which is not installed. Install the MindSpeed branch matching "
            f"your megatron-core version ({_megatron_version()}): git clone -b <branch> "
            f"https://gitcode.com/Ascend/MindSpeed.git && pip install -e MindSpeed (branches and their torch / "
            f"torch_npu / CANN versions: {VERSION_TABLE}). Or train on NPU with the Hugging Face backend "
            f"(TransformersModel), which needs no MindSpeed") from exc
    return True
