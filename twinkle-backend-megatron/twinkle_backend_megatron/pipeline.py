"""Pipeline parallelism of a ``MegatronModel``: megatron-core's schedules (1F1B, interleaved with ``vpp > 1``).

The batch is split into the strategy's micro-batches; the last stage scores each one with the adapter's loss,
and the loss, token count, outputs and metrics are then made known on every stage.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch

from twinkle_backend_megatron.forward import call_chunk
from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.loss.base import LossOutput
from twinkle_core.model.step_context import StepContext
from twinkle_core.model.train_state import TrainState

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class MegatronPipeline:
    """megatron-core's schedule over one batch for a model's ``chunks``, run with the step's state and adapter.

    ``task`` turns logits into the task's outputs, ``loss_context`` is what the model hands its losses, and
    ``unwrap`` gives the ``GPTModel`` inside a chunk as the strategy wrapped it. With a ``loss_context.vocab_shard``
    the last stage's output is this rank's vocabulary slice: the losses take it as is, ``forward_only`` gathers it.
    """

    def __init__(self, chunks: list[Any], *, strategy: Any, vocab_size: int, task: Any, loss_context: Any,
                 unwrap: Callable[[Any], Any], run_chunk: Callable[..., Any] = call_chunk,
                 split: Callable[[dict[str, Any], int], list[dict[str, Any]]] | None = None) -> None:
        self.chunks, self.strategy, self.vocab_size = chunks, strategy, vocab_size
        self.task, self.loss_context, self.unwrap = task, loss_context, unwrap
        #: how a stage runs its chunk on a micro-batch, and how the batch is cut into micro-batches (a
        #: vision-language batch cuts its images with its rows, vision.py)
        self.run_chunk, self.split = run_chunk, split or split_rows

    def run(self, step: StepContext, inputs: dict[str, Any], *, forward_only: bool) -> dict[str, Any]:
        """``forward_backward`` (``forward_only=False``) or ``forward_only`` of the batch ``inputs``."""
        inputs = step.to_device(self.strategy.prepare_inputs(dict(inputs)))
        pieces = self._micro_batches(inputs)
        if not forward_only:
            _ = step.loss  # the task's default loss, set before the schedule scores the first micro-batch
            # every stage needs the window's divisor before the last stage has computed a loss: count the labels
            step.state.open_window(_label_count(inputs), self.strategy, step.device)
        scored: list[tuple[dict[str, Any], LossOutput | None]] = []  # (outputs, loss) per micro-batch, last stage
        self._run_schedule(step, pieces, self._forward_step(step.state, scored, forward_only=forward_only),
                           forward_only=forward_only)
        if forward_only:
            return self._evaluation_outputs(scored, inputs, step.device)
        return self._training_outputs(step, scored)

    def _micro_batches(self, inputs: dict[str, Any]) -> list[dict[str, Any]]:
        """The batch split into the strategy's ``num_microbatches`` equal pipeline micro-batches (row-wise)."""
        return self.split(inputs, self.strategy.num_microbatches)

    def _task_outputs(self, outputs: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
        return self.task.process_outputs(outputs, inputs) if self.task is not None else outputs

    def _forward_step(self, state: TrainState, scored: list[tuple[dict[str, Any], LossOutput | None]], *,
                      forward_only: bool) -> Any:
        """megatron-core's ``forward_step_func``: run a chunk; on the last stage, score its output into ``scored``."""
        vocab = self.vocab_size

        def forward_step(data_iterator: Any, chunk: Any) -> Any:
            batch = next(data_iterator)

            def loss_func(output_tensor: torch.Tensor) -> Any:
                logits = output_tensor
                if forward_only or self.loss_context.vocab_shard is None:
                    logits = _whole_vocabulary(output_tensor, self.loss_context.vocab_shard)[..., :vocab]
                if forward_only:  # the task sees the whole batch once the logits reached every stage
                    scored.append(({"logits": logits.detach()}, None))
                    return output_tensor.sum() * 0.0, torch.tensor(0, dtype=torch.int), {}
                outputs = self._task_outputs({"logits": logits}, batch)
                result = state.apply_loss(outputs, batch, self.loss_context)
                scored.append(({k: v.detach() if torch.is_tensor(v) else v for k, v in outputs.items()}, result))
                scaled = self.strategy.scale_loss(state.scale_for_backward(result.loss))
                return scaled, torch.tensor(int(float(result.num_tokens)), dtype=torch.int), {}

            return self.run_chunk(chunk, batch, self.unwrap), loss_func

        return forward_step

    def _run_schedule(self, step: StepContext, pieces: list[dict[str, Any]], forward_step: Any, *,
                      forward_only: bool) -> None:
        """Run megatron-core's pipeline schedule (1F1B, interleaved with ``vpp > 1``) over the micro-batches."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        chunks = self.chunks
        size, length = pieces[0]["input_ids"].shape
        grad_context = torch.no_grad() if forward_only else contextlib.nullcontext()
        for chunk in chunks:
            chunk.train(not forward_only)
        try:
            with step.adapter_scope(), self.strategy.forward_context(step.device.type), grad_context:
                get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=[iter(pieces) for _ in chunks],
                    model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=len(pieces), seq_length=length,
                    micro_batch_size=size, forward_only=forward_only)
        finally:
            for chunk in chunks:
                chunk.train()

    def _evaluation_outputs(self, scored: list[tuple[dict[str, Any], None]], inputs: dict[str, Any],
                            device: torch.device) -> dict[str, Any]:
        """The last stage's logits on every stage, then the task's outputs of the whole batch."""
        logits = torch.cat([outputs["logits"] for outputs, _ in scored]) if _is_last_stage() else None
        logits = self._logits_from_last_stage(logits, tuple(inputs["input_ids"].shape), device)
        with self.strategy.forward_context(device.type), torch.no_grad():
            return self._task_outputs({"logits": logits}, inputs)

    def _logits_from_last_stage(self, logits: torch.Tensor | None, shape: tuple[int, int],
                                device: torch.device) -> torch.Tensor:
        """Broadcast the last stage's ``logits`` (``None`` elsewhere) of a ``shape`` batch to every stage."""
        dtype_index = torch.tensor([_DTYPES.index(logits.dtype) if logits is not None else 0], dtype=torch.long,
                                   device=device)
        _broadcast_from_last_stage(dtype_index)
        if logits is None:
            logits = torch.empty((*shape, self.vocab_size), dtype=_DTYPES[int(dtype_index)], device=device)
        else:
            logits = logits.contiguous()
        _broadcast_from_last_stage(logits)
        return logits

    def _training_outputs(self, step: StepContext, scored: list[tuple[dict[str, Any], LossOutput]]) -> dict[str, Any]:
        """Record the window's backward and report the loss on every stage (outputs and metrics on the last)."""
        results = [result for _, result in scored]
        loss_sum, tokens = _loss_totals(results, step.device)
        step.state.record_backward(tokens)
        out: dict[str, Any] = {"loss": torch.tensor(loss_sum / tokens if tokens else math.nan), "num_tokens": tokens}
        if _is_last_stage():
            out = {**_join_micro_batches([outputs for outputs, _ in scored]), **out, **_mean_metrics(results)}
        return out


def split_rows(inputs: dict[str, Any], micro: int) -> list[dict[str, Any]]:
    """``inputs`` cut into ``micro`` equal pipeline micro-batches of rows (every tensor with a row per batch row)."""
    rows = inputs["input_ids"].shape[0]
    if rows % micro:
        raise ConfigError(f"a batch of {rows} rows cannot be split into num_microbatches={micro} equal pipeline "
                          f"micro-batches; change the batch size or strategy_options num_microbatches")
    size = rows // micro
    per_row = {k for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows}
    return [{k: v[i * size:(i + 1) * size] if k in per_row else v for k, v in inputs.items()}
            for i in range(micro)]


def metrics_from_last_stage(compute: Callable[[], dict[str, float]], state: TrainState, *,
                            reset: bool) -> dict[str, float]:
    """``calculate_metric`` under pipeline parallelism: metrics are updated where the loss is computed, the last
    stage, which runs ``compute``; the other stages reset theirs (with ``reset``) and receive the result."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    holder: list[Any] = [None]
    if _is_last_stage():
        holder[0] = compute()
    elif reset:
        for metric in state.metrics:
            metric.reset()
    dist.broadcast_object_list(holder, src=ps.get_pipeline_model_parallel_last_rank(),
                               group=ps.get_pipeline_model_parallel_group())
    return holder[0]


def _loss_totals(results: list[LossOutput], device: torch.device) -> tuple[float, float]:
    """``(sum loss, tokens)`` of the micro-batches, computed on the last stage, known on every stage."""
    totals = torch.tensor([sum(float(r.loss.detach()) for r in results), sum(float(r.num_tokens) for r in results)],
                          dtype=torch.float64, device=device)
    _broadcast_from_last_stage(totals)
    return float(totals[0]), float(totals[1])


def _label_count(inputs: dict[str, Any]) -> float:
    """Tokens a loss will count in ``inputs``: labelled ones (not ``IGNORE_INDEX``), else every input token."""
    labels = inputs.get("labels")
    return float((labels != IGNORE_INDEX).sum()) if labels is not None else float(inputs["input_ids"].numel())


def _is_last_stage() -> bool:
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True)


def _broadcast_from_last_stage(tensor: torch.Tensor) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.broadcast(tensor, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())


def _join_micro_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The micro-batches' per-row outputs (logits, task outputs) joined into the batch's."""
    return {key: torch.cat([part[key] for part in parts]) for key, value in parts[0].items()
            if torch.is_tensor(value) and value.dim()}


def _mean_metrics(results: list[LossOutput]) -> dict[str, float]:
    """Each extra metric a loss reported, averaged over the micro-batches that reported it."""
    values: dict[str, list[float]] = {}
    for result in results:
        for key, value in result.metrics.items():
            values.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in values.items()}


def _whole_vocabulary(logits: torch.Tensor, shard: Any) -> torch.Tensor:
    """``logits``, gathered over the tensor-parallel ranks when they are this rank's vocabulary ``shard``."""
    if shard is None:
        return logits
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    return gather_from_tensor_model_parallel_region(logits)
