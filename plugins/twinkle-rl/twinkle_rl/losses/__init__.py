"""The preference losses: ``dpo`` (sigmoid / hinge / ipo / robust), ``simpo`` and ``orpo``.

Each reads answer pairs through :mod:`twinkle_rl.layout` (the ``preference`` task builds that layout) and
returns ``LossOutput(loss=<sum over pairs>, num_tokens=<number of pairs>)``.
"""

from twinkle_rl.losses.base import PairLogps, PreferenceLoss
from twinkle_rl.losses.dpo import DPOLoss
from twinkle_rl.losses.orpo import ORPOLoss
from twinkle_rl.losses.simpo import SimPOLoss

__all__ = ["DPOLoss", "ORPOLoss", "PairLogps", "PreferenceLoss", "SimPOLoss"]
