"""Values that several layers must agree on, defined once (importing this module imports nothing else).

:data:`IGNORE_INDEX` is the label that means "no loss here": the data pipeline writes it on prompt tokens,
padding and the boundaries of packed sequences; every loss and metric skips it; the trainer's label check
counts what is not it. It equals PyTorch's and Hugging Face's default (``torch.nn.CrossEntropyLoss``'s
``ignore_index``, transformers' ``-100``), so batches and losses from those libraries mix with Twinkle's.
"""

from __future__ import annotations

#: the label value no loss term is taken on (masked prompt tokens, padding, packed-sequence boundaries)
IGNORE_INDEX = -100

__all__ = ["IGNORE_INDEX"]
