"""Which tokens of a sequence each rank of a ring context-parallel group holds.

Two layouts, for a sequence of ``L`` tokens over ``R`` ranks:

* ``contiguous``: rank ``r`` holds tokens ``[r L/R, (r+1) L/R)`` (``L`` a multiple of ``R``);
* ``zigzag``: the sequence is cut into ``2R`` chunks and rank ``r`` holds chunks ``r`` and
  ``2R-1-r`` (``L`` a multiple of ``2R``). Under causal attention every rank then has the same
  amount of work: an early chunk (little to attend to) paired with a late one (much to attend to).

The ring attention (:mod:`.ring_attention`) needs only the global token index of each local token,
:func:`local_indices`, to apply the causal rule exactly; the helpers below shard and reassemble
tensors along their sequence dimension in either layout.

Hybrid (Ulysses inside a group x ring across groups): the ``W = cp * sp`` ranks that share rows are laid
out ring-major, ``rank = c * sp + s``. Ring rank ``c`` owns its share of the sequence in the ring layout
over ``cp`` ranks (:func:`local_indices`), and that share is cut contiguously into ``sp`` pieces, piece ``s``
for rank ``c * sp + s`` (:func:`nested_indices`). Ulysses' all-to-all over the ``sp`` ranks of ring rank
``c`` then reassembles exactly ring rank ``c``'s share, in order, which the ring attention expects.
With ``sp = 1`` this is the ring layout, with ``cp = 1`` the contiguous one.
"""

from __future__ import annotations

import torch

from twinkle_core.errors import ConfigError

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ConfigError(f"unknown ring layout {layout!r}; choose one of {', '.join(LAYOUTS)}")


def length_multiple(world: int, layout: str) -> int:
    """The global sequence length must be a multiple of this (pad the batch up to it)."""
    check_layout(layout)
    return 2 * world if layout == "zigzag" else world


def local_indices(length: int, world: int, rank: int, layout: str,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The global indices (ascending) of the ``length / world`` tokens that ``rank`` holds."""
    multiple = length_multiple(world, layout)
    if length % multiple:
        raise ConfigError(f"a sequence of {length} tokens cannot be split over {world} ranks in the {layout} "
                          f"layout: pad it to a multiple of {multiple}")
    if layout == "contiguous":
        size = length // world
        return torch.arange(rank * size, (rank + 1) * size, device=device)
    size = length // (2 * world)
    first = torch.arange(rank * size, (rank + 1) * size, device=device)
    last = 2 * world - 1 - rank
    return torch.cat([first, torch.arange(last * size, (last + 1) * size, device=device)])


def shard_sequence(x: torch.Tensor, world: int, rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """``rank``'s share of ``x`` along ``dim`` (the sequence dimension)."""
    index = local_indices(x.shape[dim], world, rank, layout, device=x.device)
    return x.index_select(dim, index)


def unshard_sequence(shards: list[torch.Tensor], layout: str, dim: int = 1) -> torch.Tensor:
    """Reassemble the whole sequence from every rank's shard (in rank order), the inverse of :func:`shard_sequence`."""
    world = len(shards)
    joined = torch.cat(shards, dim=dim)
    length = joined.shape[dim]
    order = torch.cat([local_indices(length, world, r, layout, device=joined.device) for r in range(world)])
    return joined.index_select(dim, torch.argsort(order))


def causal_window(length: int, world: int, rank: int, source: int,
                  layout: str) -> tuple[slice, slice, torch.Tensor, torch.Tensor] | None:
    """Under causal attention, the part of ``rank``'s queries x ``source``'s keys that can meet.

    Only the query rows at or after ``source``'s first key (a suffix: local indices ascend) and the key
    columns at or before ``rank``'s last query (a prefix) can; returns those two slices and the global
    indices of the rows and columns they keep, or ``None`` when no query sees any key. In the zig-zag
    layout an off-diagonal pair keeps one chunk pair (half the block), wholly visible; every rank then
    computes the same number of scores in total."""
    q_index = local_indices(length, world, rank, layout)
    k_index = local_indices(length, world, source, layout)
    if int(k_index[0]) > int(q_index[-1]):
        return None
    rows = slice(int(torch.searchsorted(q_index, k_index[0])), None)
    cols = slice(0, int(torch.searchsorted(k_index, q_index[-1], right=True)))
    return rows, cols, q_index[rows], k_index[cols]


def nested_multiple(world: int, ring: int, layout: str) -> int:
    """The global length must be a multiple of this to split over ``world`` ranks, ``ring`` of them in the ring."""
    return length_multiple(ring, layout) * (world // ring)


def nested_indices(length: int, world: int, ring: int, rank: int, layout: str,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """The global indices (ascending) held by ``rank`` of ``world = ring * inner`` ranks laid out ring-major:
    piece ``rank % inner`` of ring rank ``rank // inner``'s share in ``layout`` (see the module doc)."""
    if ring < 1 or world % ring:
        raise ConfigError(f"a ring of {ring} ranks does not divide the {world} ranks that share a sequence")
    inner = world // ring
    multiple = nested_multiple(world, ring, layout)
    if length % multiple:
        raise ConfigError(f"a sequence of {length} tokens cannot be split over {ring} ring x {inner} Ulysses "
                          f"ranks in the {layout} layout: pad it to a multiple of {multiple}")
    share = local_indices(length, ring, rank // inner, layout, device=device)
    piece = share.numel() // inner
    return share[(rank % inner) * piece: (rank % inner + 1) * piece]


def unshard_nested(shards: list[torch.Tensor], ring: int, layout: str, dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's :func:`nested_indices` shard (in rank order)."""
    world = len(shards)
    joined = torch.cat(shards, dim=dim)
    length = joined.shape[dim]
    order = torch.cat([nested_indices(length, world, ring, r, layout, device=joined.device) for r in range(world)])
    return joined.index_select(dim, torch.argsort(order))
