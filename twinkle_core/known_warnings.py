"""Third-party warnings that are noise in a Twinkle run, filtered in one place.

Each entry of :data:`KNOWN_WARNINGS` is one message of one library, matched exactly: its category, the start of
its text and the module it is attributed to (``warnings.filterwarnings``), never a whole category or library.
They are warnings a user can do nothing about, printed by code Twinkle calls (measured on CPU, 10-step runs):

* torch deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which DeepSpeed ZeRO-3 and
  Megatron-core call on every step; a ``FutureWarning`` is printed again each time something resets the warning
  registry (42 in 10 steps of ``examples/zero3``, 2,000 in 500);
* Megatron-core says at import, once per module and rank, that Apex / Transformer Engine are not installed and it
  falls back to its torch implementations (12 per 2-process run); Twinkle does not use Apex or Transformer Engine;
* transformers deprecates ``is_gradient_checkpointing``, which PEFT reads when it wraps a model (every LoRA run);
* Megatron-core's ``dist_checkpointing`` loads with torch's deprecated ``load_state_dict`` and ``ShardedTensor``
  (6 per 2-process ``--resume`` of ``examples/megatron``).

Not filtered here, because Twinkle removes their cause instead: the data cache's "not a shared file system?"
(ranks no longer look for an entry before the process group exists), DeepSpeed's "Setting accelerator to CPU"
at the first save of a run without DeepSpeed (the backend no longer imports DeepSpeed there), torchrun's
``OMP_NUM_THREADS`` notice (the launcher sets the variable, :mod:`twinkle_core.threads`) and Megatron's
"full scope is deprecated" (the Megatron backend passes the new default).

``twinkle`` applies the filters when a command starts, in every process (each rank of a launched job runs the
command too; the Ray runtime's workers apply them when they start training). ``TWINKLE_SHOW_WARNINGS=1`` (or
``twinkle train --show-warnings``, which sets it for every rank) shows them all again.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

#: set to 1 to see the warnings :data:`KNOWN_WARNINGS` hides
SHOW_VARIABLE = "TWINKLE_SHOW_WARNINGS"


@dataclass(frozen=True)
class KnownWarning:
    """One third-party warning: ``message`` is the literal start of its text, ``module`` a regular expression of
    the module ``warnings`` attributes it to (matched at the start of the name, as ``warnings.filterwarnings``
    does), ``why`` what it is and why it is noise."""

    category: type[Warning]
    message: str
    module: str
    why: str

    def install(self) -> None:
        warnings.filterwarnings("ignore", message=re.escape(self.message), category=self.category,
                                module=self.module)


_TORCH_COLLECTIVES = "torch\\.distributed\\.c10d_logger$"
_MEGATRON = "megatron\\.core(\\.|$)"

KNOWN_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning(FutureWarning, "`torch.distributed.all_gather_into_tensor` is deprecated.", _TORCH_COLLECTIVES,
                 "DeepSpeed ZeRO-3 and Megatron-core gather parameters with it on every step"),
    KnownWarning(FutureWarning, "`torch.distributed.reduce_scatter_tensor` is deprecated.", _TORCH_COLLECTIVES,
                 "DeepSpeed ZeRO-3 reduces gradients with it on every step"),
    KnownWarning(FutureWarning, "`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                 "transformers\\.modeling_utils$", "PEFT reads the property when it wraps a model for LoRA"),
    KnownWarning(FutureWarning, "`load_state_dict` is deprecated and will be removed in future versions.", _MEGATRON,
                 "Megatron-core's dist_checkpointing loads a checkpoint with it (every --resume)"),
    KnownWarning(FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor.",
                 "torch\\.distributed\\.checkpoint\\.(planner_helpers|default_planner)$",
                 "torch's checkpoint planner reading Megatron-core's ShardedTensors (every --resume)"),
    KnownWarning(UserWarning, "Apex is not installed. Falling back to Torch Norm", _MEGATRON,
                 "Megatron-core at import: its torch LayerNorm / RMSNorm are the ones Twinkle uses"),
    KnownWarning(UserWarning, "Transformer Engine and Apex are not installed. Falling back to ", _MEGATRON,
                 "Megatron-core at import: its torch optimizers and multi-tensor kernels are the ones Twinkle uses"),
)


def quiet_known_warnings(show: bool = False) -> bool:
    """Ignore each of :data:`KNOWN_WARNINGS` in this process, unless ``TWINKLE_SHOW_WARNINGS`` is on or ``show``
    (``--show-warnings``: then ``TWINKLE_SHOW_WARNINGS=1`` is set for the processes this one starts). Returns
    whether the filters were installed (installing them again leaves one copy of each)."""
    from twinkle_core.envflags import env_flag

    if show:
        os.environ[SHOW_VARIABLE] = "1"
    if env_flag(SHOW_VARIABLE):
        return False
    for known in KNOWN_WARNINGS:
        known.install()
    return True


__all__ = ["KNOWN_WARNINGS", "SHOW_VARIABLE", "KnownWarning", "quiet_known_warnings"]
