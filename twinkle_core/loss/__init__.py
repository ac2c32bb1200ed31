"""Losses built into the core. Import concrete losses from their modules (they need torch)."""

from twinkle_core.loss.base import CallableLoss, Loss, LossOutput

__all__ = ["CallableLoss", "Loss", "LossOutput"]
