"""The loss contract."""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from twinkle_core.loss.vocab_parallel import VocabShard


@dataclass
class LossOutput:
    """A loss summed over ``num_tokens`` units (tokens, sequences or pairs).

    The model divides accumulated gradients by the *global* ``num_tokens`` before the optimizer
    step, which is what makes gradient accumulation and data parallelism exact. A loss that is
    already a mean reports ``num_tokens=1``.

    ``num_tokens=0`` means "do not normalise": the window's loss divisor is ``max(1, 0) = 1`` and the
    normalisation factor ``Strategy.gradient_scale(0)`` is ``1 / max(0, 1) = 1`` (times the ranks a
    data-parallel wrapper averages over, so that the result is a sum over ranks too), so the gradients of
    every ``forward_backward`` call up to the optimizer step are summed exactly as they are (the
    sum-loss semantics of Tinker's losses). Every call of the window must then report ``0``: one that
    reports a count makes the step divide the whole window by it.
    """

    loss: torch.Tensor
    num_tokens: torch.Tensor | int
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def mean(self) -> torch.Tensor:
        """``loss / num_tokens``; ``loss`` itself for ``num_tokens=0``. A count may be fractional: a rank's share of
        whole sequences under sequence parallelism (half a pair on each of 2 ranks) is not rounded up to 1."""
        count = float(self.num_tokens)
        return self.loss / count if count > 0 else self.loss


@dataclass(frozen=True)
class LossContext:
    """The parallel layout a loss may need, handed to every loss call as ``context=``.

    The strategy builds it (:meth:`twinkle_core.strategy.Strategy.loss_context`). A loss that compares
    samples across the global batch (InfoNCE's in-batch negatives) gathers over ``dp_group``; one that
    scores a sequence sliced over ranks (Ulysses) reduces over ``sp_group``. ``None`` groups mean "the
    whole world" for data parallelism and "not sliced" for sequence parallelism.

    ``vocab_shard`` (a :class:`~twinkle_core.loss.vocab_parallel.VocabShard`: ``start``, ``end``, the real
    ``vocab_size`` and the tensor-parallel ``group``) says that ``outputs["logits"]`` hold only this rank's slice
    ``start:end`` of the (padded) vocabulary: the built-in losses then take the softmax across the group without
    ever gathering ``[tokens, vocab]`` (:mod:`twinkle_core.loss.vocab_parallel`), and a loss that needs whole
    distributions raises a ``ConfigError``. ``None`` (the default): the logits are the full vocabulary.

    ``sp_group`` / ``sp_size`` are the *sequence group*: every rank that holds a slice of the same rows (Ulysses
    ``sp`` times ring ``cp``). A per-sequence loss sums its slices' values over it with
    :func:`twinkle_core.loss.sequence_group.sequence_reduction`, which also says what share of the whole-sequence loss
    each rank reports so that the group counts every sequence once.
    """

    dp_group: Any = None
    dp_size: int = 1
    dp_rank: int = 0
    sp_group: Any = None
    sp_size: int = 1
    vocab_shard: VocabShard | None = None


def vocab_shard_of(context: LossContext | None) -> VocabShard | None:
    """The context's vocabulary shard, or ``None`` (no context, or full-vocabulary logits)."""
    return None if context is None else context.vocab_shard


class Loss(ABC):
    """A loss: ``loss(outputs, inputs, context=None) -> LossOutput``.

    ``outputs`` is the model's output mapping (``logits`` at least, or what the task's
    ``process_outputs`` made of it); ``inputs`` is the batch (``labels`` and whatever the loss needs,
    e.g. ``ref_logps`` for DPO, ``advantages`` for GRPO); ``context`` is the :class:`LossContext` of the
    running strategy. Subclasses take their hyper-parameters as keyword arguments of ``__init__``::

        class SumOfLogits(Loss):
            name = "sum_of_logits"

            def __call__(self, outputs, inputs, context=None):
                return LossOutput(loss=outputs["logits"].sum(), num_tokens=outputs["logits"].numel())
    """

    name: ClassVar[str] = ""
    #: batch features the loss reads that only some tasks produce (``Task.provides``); a recipe pairing this
    #: loss with a task that does not provide them is refused before anything is built
    requires: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput: ...

    @property
    def where(self) -> str:
        """How the loss names itself in its error messages (its class name: ``GRPOLoss needs inputs[...]``)."""
        return type(self).__name__

    def fuses_lm_head(self, vocab_size: int) -> bool:
        """Whether this loss applies the LM head itself for a ``vocab_size``-entry vocabulary.

        When it says so and the model can (its backend knows its LM head is a plain linear layer, its strategy
        keeps whole weights, no metric or task reads logits), ``forward_backward`` hands the loss
        ``outputs["hidden_states"]`` (the final, normed ``[B, T, H]`` states, in the head's compute dtype) and
        ``outputs["lm_head_weight"]`` (``[V, H]``, optionally ``"lm_head_bias"``) instead of ``outputs["logits"]``,
        which are then never computed: see :mod:`twinkle_core.loss.fused_head`. ``forward`` and
        ``forward_only`` always return logits.
        """
        return False


def require_whole_sequences(inputs: dict[str, Any], where: str, context: LossContext | None = None) -> None:
    """For a loss that needs every token of a sequence on one rank and cannot sum over the ranks that split it:
    refuse a sequence-parallel slice, marked by the core as ``shift_labels`` without ``labels``, or a context with
    ``sp_size > 1``. A loss that only needs per-sequence *sums* (DPO, GRPO ...) takes them over the sequence group
    with :func:`twinkle_core.loss.sequence_group.sequence_reduction` instead."""
    sliced = "shift_labels" in inputs and inputs.get("labels") is None
    if sliced or (context is not None and context.sp_size > 1):
        raise ValueError(f"{where} sums log-probs per sequence and does not support sequence parallelism "
                         f"(the batch holds only a slice of each sequence); train it with mesh.sp=1")


def accepts_context(fn: Any) -> bool:
    """Whether ``fn`` can be called with ``context=`` (losses written before the context existed cannot)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: call them the old way
        return False
    return any(p.name == "context" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class CallableLoss(Loss):
    """Adapts a plain function ``fn(outputs, inputs[, context=]) -> LossOutput | Tensor`` to :class:`Loss`.

    A bare tensor is taken as an already-averaged loss (``num_tokens=1``). ``context`` is passed only to a
    function that accepts it.
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.name = getattr(fn, "name", None) or getattr(fn, "__name__", "callable")
        self._pass_context = accepts_context(fn)

    def __call__(self, outputs: dict[str, Any], inputs: dict[str, Any],
                 context: LossContext | None = None) -> LossOutput:
        result = self.fn(outputs, inputs, context=context) if self._pass_context else self.fn(outputs, inputs)
        if isinstance(result, LossOutput):
            return result
        return LossOutput(loss=result, num_tokens=1)
