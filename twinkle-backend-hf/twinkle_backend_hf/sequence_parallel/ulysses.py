"""Ulysses sequence parallelism for ``transformers`` models, plugged in through ``AttentionInterface``.

Layout
------
Every rank of a sequence-parallel (SP) group of size ``P`` holds the same rows of the batch but only
``1/P`` of each sequence (a contiguous chunk, rank ``i`` holding chunk ``i``). Everything outside
attention (embeddings, norms, MLPs, the LM head) is position-wise and runs on the local chunk as is.
Attention is the one place that needs the whole sequence; :func:`ulysses_attention_forward`, which
``transformers`` calls in place of its own attention function, does

1. an all-to-all of ``query``/``key``/``value`` from ``[B, H, S/P, D]`` (all heads, local chunk) to
   ``[B, H/P, S, D]`` (a ``1/P`` share of the heads, whole sequence);
2. the *inner* attention function from the registry (``sdpa`` by default) on that, causal, with a
   block-diagonal mask built from the *global* ``position_ids`` when the rows are packed;
3. the inverse all-to-all of the output, from ``[B, S, H/P, D]`` back to ``[B, S/P, H, D]``.

The all-to-alls are :class:`_SeqAllToAll`, an autograd function whose backward is the inverse
all-to-all of the incoming gradient, so gradients are exact (no approximation, no extra reduction).

Grouped-query attention: rank ``r`` takes query heads ``[r H/P, (r+1) H/P)`` and key/value heads
``[r Hkv/P, (r+1) Hkv/P)``, which keeps each query head with its own key/value head. When ``Hkv`` is
not a multiple of ``P`` (e.g. 2 kv heads, ``P = 4``), each kv head is first repeated
``f = P / gcd(Hkv, P)`` times (autograd sums the copies' gradients back), and the inner function is
told that each kv head now serves ``H / (f Hkv)`` query heads.

Masks
-----
The model never builds a mask for this attention implementation (its name is not in
``transformers``' mask registry, so ``create_causal_mask`` returns ``None``; a mask built for the
local chunk would be wrong anyway). The attention function rebuilds what it needs from the
``position_ids`` it receives (the model forwards them to the attention function), all-gathered over
the SP group once per forward (cached on the identity of the ``position_ids`` tensor):

* no reset in any row: plain causal attention (``is_causal=True``, no mask tensor);
* resets (a position that is not the previous one plus one): packed sequences; the mask is
  ``causal & same-sequence`` exactly like ``transformers``' own packed-sequence mask.

:func:`.batch_sharding.shard_batch` turns a batch's ``attention_mask`` into that form: a mask of ones, or right
padding, is dropped (under causal attention nothing real attends to a later pad); left padding is
expressed by giving pad tokens the position ``PAD_POSITION`` (``-2``), which isolates each of them
as a one-token sequence, while real tokens keep their positions.

Inner functions: ``sdpa`` (tested); the flash-attention entries of the registry get the global
``position_ids`` (their varlen path finds the packed sequences there) instead of a mask, which is
wired but untested here (no GPU). A model configured with ``eager`` gets ``sdpa`` inside, which
computes the same attention. ``twinkle_ring`` (the hybrid, :mod:`.ring_attention` over the ``cp`` group,
tested) gets the ``sp``-gathered positions like the flash kernels.

Not supported (errors are raised where they can be detected): padding *inside* a row (zeros
between real tokens), 4-D custom masks, sliding-window layers, ``flex_attention`` as the inner
function, KV caches (the backend runs the model with ``use_cache=False``), 3-D (multimodal RoPE)
``position_ids``, head counts that cannot be split (``H`` must be a multiple of ``P``, and ``H/Hkv``
a multiple of ``P / gcd(Hkv, P)``), and attention dropout reproducing the single-process random
pattern. Models must pass ``position_ids`` through to the attention function (Llama, Qwen2/2.5/3,
Mistral-style decoders do); without them a packed batch would be treated as plain causal.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from twinkle_core.errors import ConfigError

ATTENTION_PREFIX = "twinkle_ulysses_"
#: the ring attention's registered name (:mod:`.ring_attention`): the inner function of the hybrid (Ulysses inside
#: a group x ring across groups); like the flash kernels it takes packing from the global ``position_ids``
RING_INNER = "twinkle_ring"
SUPPORTED_INNER = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4", RING_INNER)


# ====================================================================== process group
@dataclass
class _SPState:
    group: Any = None
    size: int = 1
    rank: int = 0


_STATE = _SPState()


def set_sequence_parallel_group(group: Any) -> None:
    """Make ``group`` (a ``torch.distributed`` group, ``None`` = no SP) the one attention splits over."""
    if group is None:
        _STATE.group, _STATE.size, _STATE.rank = None, 1, 0
    else:
        _STATE.group, _STATE.size, _STATE.rank = group, dist.get_world_size(group), dist.get_rank(group)
    _POSITION_CACHE.clear()


def sequence_parallel_group() -> Any:
    return _STATE.group


def sequence_parallel_size() -> int:
    return _STATE.size


def sequence_parallel_rank() -> int:
    return _STATE.rank


# ====================================================================== communication
def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` into ``P`` chunks, send chunk ``j`` to rank ``j``, and concatenate
    the chunks received from ranks ``0..P-1`` along ``gather_dim``."""
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[scatter_dim] % size:
        raise ValueError(f"all-to-all: dimension {scatter_dim} of shape {tuple(x.shape)} is not divisible by {size}")
    send = torch.stack(x.chunk(size, dim=scatter_dim))  # [P, ...]: contiguous, chunk j first-indexed by j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    """Differentiable all-to-all; the gradient goes through the inverse all-to-all (exact)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SeqAllToAll.apply(x, group, scatter_dim, gather_dim)


def gather_sequence(x: torch.Tensor, group: Any, dim: int = 1) -> torch.Tensor:
    """All-gather the sequence chunks of ``x`` along ``dim`` (not differentiable; for eval outputs and ids)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    x = x.detach().contiguous()
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


# ====================================================================== masks
def sequence_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Per token, the index of the packed sequence it belongs to (``None`` when no row has a reset).

    A new sequence starts wherever a position is not the previous one plus one, the rule
    ``transformers.masking_utils.find_packed_sequence_indices`` uses.
    """
    first = position_ids[:, :1] - 1
    starts = torch.diff(position_ids, prepend=first, dim=-1) != 1
    ids = starts.cumsum(-1)
    if bool((ids[:, -1] == 0).all()):
        return None
    return ids


def packed_mask(position_ids: torch.Tensor, causal: bool = True) -> torch.Tensor | None:
    """Boolean ``[B, 1, S, S]`` mask (True = attend) for packed rows, ``None`` when no row is packed."""
    ids = sequence_ids(position_ids)
    if ids is None:
        return None
    mask = ids[:, :, None] == ids[:, None, :]
    if causal:
        length = ids.shape[-1]
        mask &= torch.ones(length, length, dtype=torch.bool, device=ids.device).tril()
    return mask[:, None]


class _PositionCache:
    """One slot: the global positions/mask of the last local ``position_ids`` tensor seen.

    Every layer of one forward (and a gradient-checkpoint recompute) receives the same tensor, so the
    all-gather runs once per forward. All ranks run the same code, so they hit or miss together. The
    entry is dropped when that tensor is freed, so a packed mask does not outlive its batch.
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._ref: Any = None
        self._masks: dict[bool, torch.Tensor | None] = {}
        self._global: torch.Tensor | None = None

    def _drop(self, ref: Any) -> None:
        if self._ref is ref:
            self.clear()

    def lookup(self, local: torch.Tensor, batch: int, group: Any, causal: bool,
               need_mask: bool = True) -> tuple[torch.Tensor, Any]:
        if self._ref is None or self._ref() is not local:
            if local.dim() != 2:
                raise NotImplementedError(
                    f"Ulysses attention needs 2-D position_ids [batch, seq]; got shape {tuple(local.shape)} "
                    f"(multimodal RoPE position ids are not supported)")
            self.clear()
            self._global = gather_sequence(local, group, dim=1)
            self._ref = weakref.ref(local, self._drop)
        positions = self._global if self._global.shape[0] == batch else self._global.expand(batch, -1)
        if not need_mask:
            return positions, None
        if causal not in self._masks:
            self._masks[causal] = packed_mask(self._global, causal)
        mask = self._masks[causal]
        if mask is not None and mask.shape[0] != batch:
            mask = mask.expand(batch, *mask.shape[1:])
        return positions, mask


_POSITION_CACHE = _PositionCache()


# ====================================================================== the attention function
class _KVGroupsView:
    """``module`` as the inner attention function must see it when kv heads were repeated."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def kv_repeat_factor(num_heads: int, num_kv_heads: int, sp: int) -> int:
    """How many times each kv head is repeated so that kv heads split evenly over ``sp`` ranks."""
    if num_heads % num_kv_heads:
        raise ConfigError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} key/value heads")
    factor = sp // math.gcd(num_kv_heads, sp)
    if num_heads % sp or (num_heads // num_kv_heads) % factor:
        raise ConfigError(
            f"Ulysses sequence parallelism cannot split {num_heads} attention heads / {num_kv_heads} key/value "
            f"heads over sp={sp} ranks: the attention heads must be a multiple of sp, and each key/value head's "
            f"{num_heads // num_kv_heads} query heads a multiple of {factor}")
    return factor


def _repeat_heads(x: torch.Tensor, factor: int) -> torch.Tensor:
    if factor == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, factor, s, d).reshape(b, h * factor, s, d)


def inner_attention_function(name: str) -> Callable[..., Any]:
    """The registered attention function Ulysses wraps (``name`` must be one of ``SUPPORTED_INNER``)."""
    from transformers import AttentionInterface

    if name not in SUPPORTED_INNER:
        raise ConfigError(f"Ulysses attention cannot wrap {name!r}; supported inner implementations: "
                          f"{', '.join(SUPPORTED_INNER)}")
    return AttentionInterface()[name]


def ulysses_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                              inner: str = "sdpa", dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: ``query`` ``[B, H, S/P, D]``, ``key``/``value`` ``[B, Hkv, S/P, D]``.

    Returns ``([B, S/P, H, D], None)`` like the built-in functions.
    """
    inner_fn = inner_attention_function(inner)
    group, size = _STATE.group, _STATE.size
    if size == 1:
        return inner_fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                        is_causal=is_causal, **kwargs)
    if attention_mask is not None:
        raise NotImplementedError(
            "Ulysses attention got an attention mask from the model (a 4-D custom mask?); pass padding-free "
            "batches (position_ids) or 2-D right/left padding masks, which the strategy converts")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("Ulysses attention does not support sliding-window attention layers")
    batch, num_heads, local_len = query.shape[0], query.shape[1], query.shape[2]
    num_kv = key.shape[1]
    factor = kv_repeat_factor(num_heads, num_kv, size)
    key, value = _repeat_heads(key, factor), _repeat_heads(value, factor)

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # varlen flash kernels and the ring take packing from position_ids, not a mask
    flash = inner.startswith("flash") or inner == RING_INNER
    local_pos = kwargs.pop("position_ids", None)
    if local_pos is None:
        mask = None
        positions = torch.arange(local_len * size, device=query.device).expand(batch, -1)
    else:
        positions, mask = _POSITION_CACHE.lookup(local_pos, batch, group, bool(causal), need_mask=not flash)

    q = seq_all_to_all(query, group, scatter_dim=1, gather_dim=2)  # [B, H/P, S, D]
    k = seq_all_to_all(key, group, scatter_dim=1, gather_dim=2)
    v = seq_all_to_all(value, group, scatter_dim=1, gather_dim=2)

    view: Any = module
    groups = num_heads // (num_kv * factor)
    if getattr(module, "num_key_value_groups", groups) != groups:
        view = _KVGroupsView(module, groups)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(name, None)  # describe the local chunk; the inner function re-derives them from positions
    if flash:
        kwargs["position_ids"] = positions
    out, _ = inner_fn(view, q, k, v, mask, dropout=dropout, scaling=scaling,
                      is_causal=bool(causal) if mask is None else False, **kwargs)
    # out: [B, S, H/P, D] -> [B, S/P, H, D]
    out = seq_all_to_all(out, group, scatter_dim=1, gather_dim=2)
    return out, None


def register_ulysses_attention(inner: str = "sdpa") -> str:
    """Register (idempotent) the Ulysses attention around ``inner`` and return its name."""
    from functools import partial, update_wrapper

    from transformers import AttentionInterface

    inner_attention_function(inner)  # validates
    name = ATTENTION_PREFIX + inner
    if name not in AttentionInterface._global_mapping:
        fn = update_wrapper(partial(ulysses_attention_forward, inner=inner), ulysses_attention_forward)
        AttentionInterface.register(name, fn)
    return name


def inner_of(attn_implementation: str | None) -> str:
    """The inner function to wrap for a model whose attention implementation is ``attn_implementation``."""
    if attn_implementation and attn_implementation.startswith(ATTENTION_PREFIX):
        return attn_implementation[len(ATTENTION_PREFIX):]
    if attn_implementation in SUPPORTED_INNER:
        return attn_implementation
    return "sdpa"  # eager and anything else: sdpa computes the same attention
