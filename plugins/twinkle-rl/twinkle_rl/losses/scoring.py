"""The options every loss over the log-probabilities of labelled tokens takes (the pair losses and the policy
losses): which label means "no token here", and how many rows the chunked log-softmax holds at once."""

from __future__ import annotations

from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import Loss
from twinkle_core.loss.logprobs import DEFAULT_CHUNK_SIZE


class TokenScoringLoss(Loss):
    def __init__(self, *, ignore_index: int = IGNORE_INDEX, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if chunk_size < 1:
            raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size
