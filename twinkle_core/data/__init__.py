"""Twinkle's data layer: row formats, chat templating, file loading, packing, batching and loading.

Nothing here imports torch, transformers or datasets at import time.
"""

from twinkle_core.data.chat_templates import resolve_chat_template, template_names
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
from twinkle_core.data.mixing import DataSource, Record, load_spec, map_columns, parse_sources
from twinkle_core.data.packing import is_packed, pack_features
from twinkle_core.data.template import Template, TemplateError

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "DataLoader",
    "DataSource",
    "InputFeature",
    "Message",
    "Record",
    "RowError",
    "Template",
    "TemplateError",
    "Trajectory",
    "collate_causal_lm",
    "is_packed",
    "is_packed_batch",
    "load_records",
    "load_rows",
    "load_spec",
    "map_columns",
    "normalize_conversation",
    "pack_features",
    "parse_sources",
    "resolve_chat_template",
    "sequence_lengths_from_position_ids",
    "template_names",
    "validate_row",
]
