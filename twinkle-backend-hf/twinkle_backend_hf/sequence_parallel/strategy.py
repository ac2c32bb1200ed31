"""``SequenceParallelStrategy``: Ulysses (``mesh.sp``) and ring (``mesh.cp``) context parallelism on top of DDP or
FSDP2 for the data dimension (:mod:`.data_parallel`).

Ranks are laid out data-parallel-major: with ``DeviceMesh(dp=D, sp=P)`` ranks ``k*P .. k*P + P - 1``
form SP group ``k``; they get the same rows (``dp_rank == k``, as the core computes it) and each
keeps chunk ``rank % P`` of every sequence (:func:`~.batch_sharding.shard_batch`, called from
``prepare_inputs``). The model's attention implementation is switched to the registered Ulysses
function (:mod:`.ulysses`) when the strategy wraps the model; nothing in the model code changes.

Gradients. Every rank back-propagates the token-*sum* loss of its own tokens, so the gradient of the
global sum loss is the *sum* of all ranks' gradients (over ``sp`` and ``dp`` alike). The data dimension
is a strategy composed in (:mod:`.data_parallel`, option ``data_parallel``): ``ddp`` (the default) wraps
the module in DDP over the whole world, ``fsdp`` shards it with FSDP2 over the whole world (sequence
ranks included; HSDP when ``mesh.dp`` and ``mesh.fsdp`` are both > 1), with DCP optimizer checkpoints.
Either reduces over every rank and averages: ``sum / world``. Hence ``gradient_average_size == world
size`` and ``gradient_scale(T) = world / T``, where ``T`` is ``global_sum`` of the local token counts
over *every* rank, giving ``d(sum loss) / T`` exactly. The wrapping, ``no_sync`` (accumulation),
gradient scaling and clipping, and the weights and optimizer checkpoints are the composed strategy's.

Outputs. ``forward`` (training) returns the local chunk's outputs (``logits`` ``[B, S/P, V]``), which
the losses pair with the local ``shift_labels``. ``forward_only`` (eval mode, no grad) returns
``logits`` gathered over the SP group and cut to the original length, so evaluation and generation
code that pairs them with the original batch keep working.

Options: ``inner_attn_implementation`` (default: the model's own when it is sdpa/flash, else sdpa),
``pad_token_id`` (for the alignment padding, default 0), ``ignore_index`` (-100),
``gather_eval_outputs`` (default True), ``shift_keys`` (loss-side keys whose ``[B, T]`` tensors are
aligned with ``labels`` and shifted like them; see :func:`~.batch_sharding.shard_batch`), ``cp_impl``
(``ulysses``, the default, or ``ring``: ring attention over the ``sp`` group, :mod:`.ring_attention`, which has
no head-count limit), ``ring_layout`` (``zigzag``, the default, or ``contiguous``; ``ring`` only),
``data_parallel`` (``ddp`` or ``fsdp``; default ``fsdp`` when ``mesh.fsdp`` > 1, else ``ddp``), plus the
options of the ``ddp`` or ``native_fsdp`` strategy it selects.

Hybrid (``mesh.cp`` beside ``mesh.sp``): ranks are laid out ``dp``-major, then ``cp``, then ``sp``; the
``cp * sp`` ranks of one data-parallel index share rows and split every sequence (the *sequence group*,
``sp_group``/``sp_size`` below, which the loss context, token counts and eval gathering use). Ring rank ``c``
owns its zig-zag share over ``cp`` (``ring_layout``), cut contiguously over its ``sp`` ranks
(:func:`~.ring_layout.nested_indices`). Attention is Ulysses' all-to-all over the ``sp`` ranks (sequence ->
heads), ring attention over the ``cp`` ranks on the gathered share, and the all-to-all back. ``mesh: {cp: N}``
alone is pure ring attention, the same as ``mesh: {sp: N}`` with ``cp_impl: ring``. Not supported: ``cp_impl:
ring`` with both ``cp`` and ``sp`` > 1 (leave ``cp_impl`` at ``ulysses`` for the hybrid), an explicit
``inner_attn_implementation`` with the ring, and a quantised base under ``data_parallel: fsdp`` (FSDP2
cannot shard bitsandbytes' weights).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from twinkle_backend_hf import quantization
from twinkle_backend_hf.sequence_parallel import batch_sharding, ring_attention, ring_layout, ulysses
from twinkle_backend_hf.sequence_parallel import data_parallel as data_parallel_strategies
from twinkle_backend_hf.strategies.collectives import ensure_process_group
from twinkle_backend_hf.strategies.model_parts import base_model
from twinkle_core import distributed
from twinkle_core.capabilities import check_mesh
from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.strategy import Strategy

if TYPE_CHECKING:
    from twinkle_core.accelerator import Accelerator
    from twinkle_core.loss.base import LossContext
    from twinkle_core.precision import Precision
    from twinkle_core.strategy import OptimizerHandle

_OWN_OPTIONS = ("inner_attn_implementation", "pad_token_id", "ignore_index", "gather_eval_outputs", "shift_keys",
                "cp_impl", "ring_layout", "data_parallel")
CP_IMPLS = ("ulysses", "ring")


_check_layout = ring_layout.check_layout  # the keyword ``ring_layout`` shadows the module in ``__init__``


def _own_group(dist: Any, members: list[range], rank: int) -> Any:
    """Create a process group for every list in ``members`` (on every rank, in order: ``new_group`` is collective)
    and return the one ``rank`` belongs to; ``None`` when the groups have one rank (nothing to communicate)."""
    own = None
    for ranks in members:
        if len(ranks) < 2:
            continue
        group = dist.new_group(list(ranks))
        if rank in ranks:
            own = group
    return own


def _inside(module: torch.nn.Module) -> torch.nn.Module:
    """The module the data-parallel strategy wrapped (DDP, or the FSDP2-sharded model itself)."""
    return module.module if isinstance(module, UlyssesModule) else module


class UlyssesModule(torch.nn.Module):
    """The strategy's wrapper: runs the (DDP-wrapped or FSDP2-sharded) model; gathers outputs in ``forward_only``."""

    def __init__(self, module: torch.nn.Module, strategy: SequenceParallelStrategy) -> None:
        super().__init__()
        self.module = module
        self._strategy = [strategy]  # a list: not registered as a submodule / not in state_dict

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.module(*args, **kwargs)
        strategy = self._strategy[0]
        if self.training or torch.is_grad_enabled() or not strategy.options["gather_eval_outputs"]:
            return out
        info = strategy.last_shard
        if info is None or strategy.sp_size == 1:
            return out
        for key in ("logits", "last_hidden_state"):
            value = out.get(key) if hasattr(out, "get") else None
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == info.local_length:
                gathered = ulysses.gather_sequence(value, strategy.sp_group, dim=1)
                layout = strategy.layout
                if layout != "contiguous":
                    gathered = ring_layout.unshard_nested(list(gathered.chunk(strategy.sp_size, dim=1)),
                                                          strategy.ring_size, layout)
                out[key] = gathered[:, : info.length]
        return out


class SequenceParallelStrategy(Strategy):
    name = "ulysses"
    averages_gradients = True
    mesh_dimensions: ClassVar[tuple[str, ...]] = ("dp", "fsdp", "cp", "sp")

    @classmethod
    def model_state_shards(cls, options: dict[str, Any], mesh: DeviceMesh) -> int:
        # FSDP2 for the data dimension shards over every rank, sequence ranks included; DDP keeps whole copies
        kind = data_parallel_strategies.data_parallel_kind(options.get("data_parallel"), mesh)
        return mesh.world_size if kind == "fsdp" else 1

    def __init__(self, mesh: DeviceMesh | None = None, *, precision: Precision | None = None,
                 inner_attn_implementation: str | None = None, pad_token_id: int = 0,
                 ignore_index: int = IGNORE_INDEX, gather_eval_outputs: bool = True,
                 shift_keys: tuple[str, ...] | list[str] = batch_sharding.SHIFT_KEYS, cp_impl: str = "ulysses",
                 ring_layout: str = "zigzag", data_parallel: str | None = None,
                 **data_parallel_options: Any) -> None:
        kind = data_parallel_strategies.data_parallel_kind(data_parallel, mesh)
        try:
            #: the strategy that synchronises (DDP) or shards (FSDP2) the data dimension, composed in
            self.data_parallel = data_parallel_strategies.build(kind, precision, data_parallel_options)
        except ConfigError as exc:
            raise ConfigError(f"strategy 'ulysses' (data_parallel: {kind}): {exc} (own options: "
                              f"{', '.join(_OWN_OPTIONS)})") from None
        if inner_attn_implementation is not None:
            ulysses.inner_attention_function(inner_attn_implementation)  # validate early
        if cp_impl not in CP_IMPLS:
            raise ConfigError(f"strategy 'ulysses': cp_impl must be one of {', '.join(CP_IMPLS)}; got {cp_impl!r}")
        _check_layout(ring_layout)
        super().__init__(mesh, precision=precision, **self.data_parallel.options,
                         inner_attn_implementation=inner_attn_implementation, pad_token_id=pad_token_id,
                         ignore_index=ignore_index, gather_eval_outputs=gather_eval_outputs,
                         shift_keys=tuple(shift_keys), cp_impl=cp_impl, ring_layout=ring_layout, data_parallel=kind)
        self.sp_group: Any = None
        self._dp_group: Any = None
        self.sp_size = 1  # ranks that split one sequence: cp * sp
        self.sp_rank = 0
        # ranks of the ring attention (mesh.cp, or mesh.sp under cp_impl ring) and of Ulysses' all-to-all
        self.ring_size, self.ulysses_size = (1, 1) if mesh is None else self.split_sizes(mesh, cp_impl)
        self.last_shard: batch_sharding.ShardInfo | None = None

    def bind_precision(self, precision: Precision) -> None:
        super().bind_precision(precision)
        self.data_parallel.bind_precision(self.precision)  # FSDP2's mixed-precision policy derives from it

    # ------------------------------------------------------------------ process groups
    def setup(self, accelerator: Accelerator) -> None:
        import torch.distributed as dist

        ensure_process_group(accelerator.dist_backend)
        if self.mesh is None:  # default: one SP group over every rank
            self.mesh = DeviceMesh(sp=distributed.world_size())
        super().setup(accelerator)
        check_mesh(self.name, self.mesh, self.mesh_dimensions)
        kind = data_parallel_strategies.data_parallel_kind(self.options["data_parallel"], self.mesh)
        self.data_parallel.mesh = data_parallel_strategies.inner_mesh(kind, self.mesh)
        self.data_parallel.setup(accelerator)
        self.ring_size, self.ulysses_size = self.split_sizes(self.mesh, self.options["cp_impl"])
        seq, world, rank = self.mesh.cp * self.mesh.sp, distributed.world_size(), distributed.rank()
        self.sp_size, self.sp_rank = seq, rank % seq
        # every rank creates every group, in the same order; ranks: dp-major, then ring, then Ulysses
        starts = range(0, world, seq)
        self.sp_group = _own_group(dist, [range(start, start + seq) for start in starts], rank)
        inner = self.ulysses_size
        ulysses_group = _own_group(dist, [range(start + c * inner, start + (c + 1) * inner)
                                          for start in starts for c in range(self.ring_size)], rank)
        ring_group = _own_group(dist, [range(start + s, start + seq, inner) for start in starts for s in range(inner)],
                                rank)
        # The ranks that hold the same chunk of different rows: a loss gathering over the data-parallel
        # ranks (in-batch negatives) must not see one row once per chunk, as it would over the world.
        self._dp_group = (_own_group(dist, [range(chunk, world, seq) for chunk in range(seq)], rank)
                          if seq > 1 and self.dp_size > 1 else None)
        ulysses.set_sequence_parallel_group(ulysses_group)
        ring_attention.set_ring_group(ring_group, self.options["ring_layout"])

    @staticmethod
    def split_sizes(mesh: DeviceMesh, cp_impl: str) -> tuple[int, int]:
        """``(ring ranks, Ulysses ranks)`` for ``mesh``: ``cp`` x ``sp``; under ``cp_impl: ring`` the one of them > 1
        is the ring (``mesh: {sp: N}`` with ``cp_impl: ring`` is ``mesh: {cp: N}``)."""
        if cp_impl != "ring":
            return mesh.cp, mesh.sp
        if mesh.cp > 1 and mesh.sp > 1:
            raise ConfigError(f"strategy 'ulysses': cp_impl 'ring' runs ring attention over one dimension, but the mesh "
                              f"has cp={mesh.cp} and sp={mesh.sp}; for Ulysses inside a group x ring across groups "
                              f"leave cp_impl at 'ulysses' (the default)")
        return mesh.cp * mesh.sp, 1

    @property
    def layout(self) -> str:
        """How the sequence is split over the ``sp`` group (see :mod:`.ring_layout`)."""
        ring = self.ring_size > 1 or self.options["cp_impl"] == "ring"
        return self.options["ring_layout"] if ring else "contiguous"

    @property
    def dp_group(self) -> Any:
        """The ranks that hold this rank's chunk of other rows (``None``: world; ``sp`` or ``dp`` is 1)."""
        return self._dp_group

    def loss_context(self) -> LossContext:
        # the loss's sequence-sliced reductions run over every rank that holds a piece of the rows: cp * sp
        return dataclasses.replace(super().loss_context(), sp_group=self.sp_group, sp_size=self.sp_size)

    # ------------------------------------------------------------------ module
    def _switch_attention(self, module: torch.nn.Module) -> None:
        model = base_model(module)
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "set_attn_implementation"):
            raise ConfigError(f"strategy 'ulysses' needs a transformers model; got {type(model).__name__}")
        if getattr(config, "use_sliding_window", False) or any(
                t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
            raise ConfigError("strategy 'ulysses' does not support sliding-window / non-full attention layers")
        current = config._attn_implementation
        name = self.attention_name(current)
        if current != name:
            model.set_attn_implementation(name)
        if model.config._attn_implementation != name:
            raise ConfigError(f"{type(model).__name__} does not dispatch attention through transformers' "
                              f"AttentionInterface, so Ulysses sequence parallelism cannot be plugged in")
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads and self.ulysses_size > 1:
            ulysses.kv_repeat_factor(heads, kv_heads, self.ulysses_size)  # fails early with a clear message

    def attention_name(self, current: str | None) -> str:
        """Register the attention this mesh needs and return its name: Ulysses around the model's own (``current``)
        or ``inner_attn_implementation``; ring attention; or Ulysses around the ring (the hybrid)."""
        ring = self.ring_size > 1 or self.options["cp_impl"] == "ring"
        if ring and self.options["inner_attn_implementation"] is not None:
            raise ConfigError("strategy 'ulysses': inner_attn_implementation does not apply when ring attention runs "
                              "(mesh cp > 1 or cp_impl 'ring'): ring attention computes the attention itself; drop it")
        if not ring:
            return ulysses.register_ulysses_attention(self.options["inner_attn_implementation"]
                                                      or ulysses.inner_of(current))
        name = ring_attention.register_ring_attention()
        return ulysses.register_ulysses_attention(name) if self.ulysses_size > 1 else name

    def wrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        if isinstance(module, UlyssesModule):
            return module
        if self.options["data_parallel"] == "fsdp" and quantization.is_quantized(base_model(module)):
            raise ConfigError("strategy 'ulysses' with data_parallel: fsdp shards parameters, and bitsandbytes' "
                              "quantised weights cannot be sharded; use data_parallel: ddp for a quantised base")
        self._switch_attention(module)
        return UlyssesModule(self.data_parallel.wrap_module(module), self)

    def unwrap_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self.data_parallel.unwrap_module(_inside(module))

    @property
    def forward_is_collective(self) -> bool:
        return self.data_parallel.forward_is_collective

    @contextlib.contextmanager
    def no_sync(self, module: torch.nn.Module) -> Iterator[None]:
        with self.data_parallel.no_sync(_inside(module)):
            yield

    def prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        sharded, self.last_shard = batch_sharding.shard_batch(
            inputs, self.sp_size, self.sp_rank, ignore_index=self.options["ignore_index"],
            pad_token_id=self.options["pad_token_id"], shift_keys=self.options["shift_keys"], layout=self.layout,
            ring_size=self.ring_size)
        return sharded

    # ------------------------------------------------------------------ gradients
    def global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over *every* rank: each holds a distinct share of the tokens (other rows or other chunks)."""
        return distributed.all_reduce_sum(value, group=None)

    @property
    def gradient_average_size(self) -> int:
        """DDP and FSDP2 average over the whole world (``dp * fsdp * cp * sp`` ranks), whose gradients must be
        summed (see :mod:`.data_parallel`)."""
        return distributed.world_size()

    def scale_gradients(self, module: torch.nn.Module, handle: OptimizerHandle, factor: float) -> None:
        self.data_parallel.scale_gradients(_inside(module), handle, factor)

    def clip_grad_norm(self, module: torch.nn.Module, handle: OptimizerHandle, max_norm: float,
                       norm_type: float = 2.0) -> torch.Tensor:
        return self.data_parallel.clip_grad_norm(_inside(module), handle, max_norm, norm_type)

    # ------------------------------------------------------------------ checkpoints (the data-parallel strategy's)
    def full_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return self.data_parallel.full_state_dict(_inside(module))

    def load_state_dict(self, module: torch.nn.Module, state_dict: dict[str, torch.Tensor],
                        strict: bool = True) -> None:
        self.data_parallel.load_state_dict(_inside(module), state_dict, strict=strict)

    def save_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        self.data_parallel.save_optimizer_state(directory, _inside(module), handle)

    def load_optimizer_state(self, directory: str, module: torch.nn.Module, handle: OptimizerHandle) -> None:
        self.data_parallel.load_optimizer_state(directory, _inside(module), handle)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "sp_size": self.sp_size, "ring_size": self.ring_size,
                "ulysses_size": self.ulysses_size}
