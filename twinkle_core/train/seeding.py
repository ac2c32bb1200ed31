"""Seeding the RNG streams of a run (Python, NumPy, torch): at the start of training, and after a resume at
another world size (:func:`twinkle_core.train.resharding.reseed`)."""

from __future__ import annotations

import random


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    import torch

    torch.manual_seed(seed)
