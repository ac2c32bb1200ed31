"""Twinkle's data layer: row formats, chat templating, file loading, packing, batching and loading.

Nothing here imports torch, transformers or datasets at import time.
"""

from twinkle_core.data.collate import collate_causal_lm, is_packed_batch, sequence_lengths_from_position_ids
from twinkle_core.data.formats import (
    IGNORE_INDEX,
    ROLES,
    InputFeature,
    Message,
    RowError,
    Trajectory,
    normalize_conversation,
)
from twinkle_core.data.loader import DataLoader
from twinkle_core.data.loading import load_records, load_rows, validate_row
from twinkle_core.data.packing import is_packed, pack_features
from twinkle_core.data.template import Template, TemplateError

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "DataLoader",
    "InputFeature",
    "Message",
    "RowError",
    "Template",
    "TemplateError",
    "Trajectory",
    "collate_causal_lm",
    "is_packed",
    "is_packed_batch",
    "load_records",
    "load_rows",
    "normalize_conversation",
    "pack_features",
    "sequence_lengths_from_position_ids",
    "validate_row",
]
