"""Padding-free packing: several sequences share one row of at most ``max_length`` tokens.

A packed row carries ``position_ids`` that restart at 0 at every sequence; the first label of every
sequence is -100, so no loss term predicts a token of one sequence from the previous one. A
backend must keep attention inside each sequence: with HF transformers >= 4.5x pass
``position_ids`` *without* ``attention_mask`` (and ``use_cache=False``) and the model derives a
block-diagonal causal mask from the position resets (sdpa / eager / flash attention).
"""

from __future__ import annotations

from collections.abc import Sequence

from twinkle_core.data.formats import IGNORE_INDEX, InputFeature


class _FirstFit:
    """Max segment tree over bin capacities: the leftmost bin with room for ``size`` in O(log n)."""

    def __init__(self, num_bins: int, capacity: int) -> None:
        self.size = 1
        while self.size < max(num_bins, 1):
            self.size *= 2
        self.tree = [0] * (2 * self.size)
        for i in range(num_bins):
            self.tree[self.size + i] = capacity
        for i in range(self.size - 1, 0, -1):
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])

    def take(self, size: int) -> int:
        if self.tree[1] < size:  # pragma: no cover - callers guarantee enough bins
            raise ValueError("no bin has room")
        node = 1
        while node < self.size:
            node = 2 * node if self.tree[2 * node] >= size else 2 * node + 1
        index = node - self.size
        self.tree[node] -= size
        node //= 2
        while node:
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])
            node //= 2
        return index


def _pack_one(group: Sequence[InputFeature]) -> InputFeature:
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    for feature in group:
        n = len(feature.input_ids)
        input_ids += feature.input_ids
        seq_labels = list(feature.labels)
        seq_labels[0] = IGNORE_INDEX
        labels += seq_labels
        position_ids += range(n)
    return InputFeature(input_ids=input_ids, labels=labels, position_ids=position_ids,
                        extra={"num_sequences": len(group)})


def pack_features(features: Sequence[InputFeature], max_length: int, *,
                  strategy: str = "first_fit_decreasing") -> list[InputFeature]:
    """Pack ``features`` into rows of at most ``max_length`` tokens (deterministic).

    ``strategy="first_fit_decreasing"`` (default) sorts by length (longest first, ties by input
    order) and puts each sequence into the first row with room, which wastes little space;
    ``"sequential"`` keeps the input order and starts a new row when the current one is full.
    Empty features are dropped; a feature longer than ``max_length`` is an error (truncate it in
    the :class:`~twinkle_core.data.template.Template` first).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be positive, got {max_length}")
    items = []
    for index, feature in enumerate(features):
        if feature.position_ids is not None:
            raise ValueError(f"feature {index} is already packed (it has position_ids)")
        n = len(feature.input_ids)
        if n > max_length:
            raise ValueError(f"feature {index} has {n} tokens, more than the packing max_length={max_length}; "
                             "set the template's max_length to at most the packing length")
        if n:
            items.append((index, feature))
    bins: list[list[InputFeature]] = []
    if strategy == "sequential":
        used = max_length
        for _, feature in items:
            n = len(feature.input_ids)
            if used + n > max_length:
                bins.append([])
                used = 0
            bins[-1].append(feature)
            used += n
    elif strategy in ("first_fit_decreasing", "ffd"):
        order = sorted(items, key=lambda item: (-len(item[1].input_ids), item[0]))
        tree = _FirstFit(len(order), max_length)
        for _, feature in order:
            index = tree.take(len(feature.input_ids))
            if index == len(bins):
                bins.append([])
            bins[index].append(feature)
    else:
        raise ValueError(f"unknown packing strategy {strategy!r}; use 'first_fit_decreasing' or 'sequential'")
    return [_pack_one(group) for group in bins]


def is_packed(feature: InputFeature) -> bool:
    return feature.position_ids is not None


__all__ = ["is_packed", "pack_features"]
