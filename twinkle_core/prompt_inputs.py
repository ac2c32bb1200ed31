"""What a prompt hands the model besides its token ids: a vision-language prompt's pictures and positions.

Online RL samples completions of a prompt and then trains on ``prompt + completion`` rows. For a text prompt the
token ids are all the model needs. A prompt that shows a picture also carries the processor's tensors and, for
Qwen-VL families, its own 3-D RoPE positions; the sampler's prefill and every training forward of that row need
the same ones. :class:`PromptInputs` is that bundle, and :func:`batch_prompt_inputs` lays a list of them out for
a batch of rows, the same way for the sampler (left-padded rows) and for training (right-padded rows), so the
tokens a completion was sampled at are the positions it is trained at.

Three kinds of values, each with one batching rule:

* ``token_values``: one value per prompt token (Qwen-VL's ``mm_token_type_ids``); 0 (text) elsewhere in a row;
* ``position_ids``: the prompt's own positions ``[D, L]`` where they are not ``0 .. L-1`` (Qwen-VL: ``D = 3``,
  temporal / height / width). The tokens after the prompt continue at ``max + 1``, ``max + 2`` ... in every
  dimension, which is what Qwen-VL's ``get_rope_index`` gives text that follows images. A row without positions
  counts ``0 .. L-1`` in every dimension;
* ``tensors``: per-prompt tensors (``pixel_values``, ``image_grid_thw`` ...), concatenated on dim 0 in row order:
  the order in which the model meets their placeholders in the flattened batch.

Example (a sampler's prefill of two left-padded rows of width 6 whose prompts have 4 and 6 tokens)::

    inputs = batch_prompt_inputs([first, second], starts=[2, 0], width=6)
    out = model(input_ids=ids, attention_mask=mask, **inputs)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class PromptInputs:
    """A prompt's model inputs besides its token ids (see the module doc)."""

    token_values: dict[str, torch.Tensor] = field(default_factory=dict)
    position_ids: torch.Tensor | None = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def check(self, length: int) -> None:
        """Refuse values that do not fit a prompt of ``length`` tokens."""
        for key, values in self.token_values.items():
            if values.dim() != 1 or values.shape[0] != length:
                raise ValueError(f"prompt input {key!r} has shape {tuple(values.shape)}; a prompt of {length} tokens "
                                 f"needs one value per token ([{length}])")
        if self.position_ids is not None and (self.position_ids.dim() != 2 or self.position_ids.shape[1] != length):
            raise ValueError(f"prompt position_ids have shape {tuple(self.position_ids.shape)}; a prompt of {length} "
                             f"tokens needs [dimensions, {length}]")

    def state(self) -> dict[str, Any]:
        """Plain dicts and tensors (what ``torch.load(weights_only=True)`` reads back): :meth:`from_state`."""
        return {"token_values": dict(self.token_values), "position_ids": self.position_ids,
                "tensors": dict(self.tensors)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> PromptInputs:
        return cls(token_values=dict(state["token_values"]), position_ids=state["position_ids"],
                   tensors=dict(state["tensors"]))


def _dimensions(inputs: Sequence[PromptInputs | None]) -> int | None:
    dims = {p.position_ids.shape[0] for p in inputs if p is not None and p.position_ids is not None}
    if len(dims) > 1:
        raise ValueError(f"prompts of one batch have positions of different dimensions {sorted(dims)}")
    return dims.pop() if dims else None


def _positions(prompt: PromptInputs | None, length: int, dims: int) -> torch.Tensor:
    if prompt is not None and prompt.position_ids is not None:
        return prompt.position_ids.to(torch.long)
    return torch.arange(length, dtype=torch.long).expand(dims, length)


def _token_values(inputs: Sequence[PromptInputs | None], starts: Sequence[int], lengths: Sequence[int],
                  width: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key in sorted({k for p in inputs if p is not None for k in p.token_values}):
        own = [(row, p.token_values[key]) for row, p in enumerate(inputs) if p is not None and key in p.token_values]
        values = out[key] = torch.zeros((len(inputs), width), dtype=own[0][1].dtype)
        for row, value in own:
            values[row, starts[row]:starts[row] + lengths[row]] = value
    return out


def _position_rows(inputs: Sequence[PromptInputs | None], starts: Sequence[int], lengths: Sequence[int],
                   width: int, dims: int) -> torch.Tensor:
    positions = torch.zeros((dims, len(inputs), width), dtype=torch.long)
    for row, prompt in enumerate(inputs):
        start, length = starts[row], lengths[row]
        own = _positions(prompt, length, dims)
        positions[:, row, start:start + length] = own
        after = width - start - length
        if after > 0:  # the completion continues from the prompt's largest position
            positions[:, row, start + length:] = (own.amax() + 1 if length else 0) + torch.arange(after)
    return positions


def batch_prompt_inputs(inputs: Sequence[PromptInputs | None], *, starts: Sequence[int], lengths: Sequence[int],
                        width: int) -> dict[str, torch.Tensor]:
    """The model inputs of ``len(inputs)`` rows of ``width`` tokens whose prompt ``s`` has ``lengths[s]`` tokens
    beginning at column ``starts[s]`` (``width - length`` for left padding, 0 for right padding). Rows without
    inputs (``None``) are text prompts. ``position_ids`` is ``[D, rows, width]`` when any prompt has positions:
    left padding gets 0, the columns after a prompt continue from its largest position (see the module doc).
    Empty when no row has inputs."""
    if not any(p is not None for p in inputs):
        return {}
    out = _token_values(inputs, starts, lengths, width)
    dims = _dimensions(inputs)
    if dims is not None:
        out["position_ids"] = _position_rows(inputs, starts, lengths, width, dims)
    for key in sorted({k for p in inputs if p is not None for k in p.tensors}):
        out[key] = torch.cat([p.tensors[key] for p in inputs if p is not None and key in p.tensors], dim=0)
    return out


def next_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The position of the token after each row of a left-padded ``position_ids`` (``[rows, width]`` or
    ``[D, rows, width]``): one more than the row's largest (padding is 0), in every dimension."""
    return position_ids.amax(dim=-1, keepdim=True) + 1


__all__ = ["PromptInputs", "batch_prompt_inputs", "next_positions"]
