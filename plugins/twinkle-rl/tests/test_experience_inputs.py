"""Experience batches of prompts with model inputs (a vision-language prompt's pictures and positions): a
micro-batch lays out its own rows' inputs, and a one-step-off checkpoint keeps them as data only."""

from __future__ import annotations

import io

import pytest
import torch
from twinkle_rl.experience import PROMPT_INPUTS, experience_batch, masked_rows, select_rows
from twinkle_rl.one_step_off import rollout_from_state, rollout_state
from twinkle_rl.rollout import Rollout

from twinkle_core.prompt_inputs import PromptInputs
from twinkle_core.sampling import Completion


def _picture(value: float, length: int) -> PromptInputs:
    positions = torch.arange(length).expand(3, length).clone()
    positions[1:, 1] = 0  # a picture token that does not advance the position
    return PromptInputs(token_values={"mm_token_type_ids": torch.tensor([0, 1] + [0] * (length - 2))},
                        position_ids=positions, tensors={"pixel_values": torch.full((2, 3), value)})


def _batch():
    prompts = [[5, 6, 7], [5, 6, 7], [8, 9, 10, 11], [8, 9, 10, 11]]
    completions = [Completion([1, 2], [-0.5, -0.6], "stop"), Completion([3], [-0.7], "stop"),
                   Completion([4, 5, 6], [-0.1, -0.2, -0.3], "length"), Completion([7], [-0.4], "stop")]
    inputs = [_picture(1.0, 3), _picture(1.0, 3), _picture(2.0, 4), _picture(2.0, 4)]
    return experience_batch(prompts, completions, pad_token_id=0, inputs=inputs), completions


def test_a_micro_batch_gets_the_pictures_and_positions_of_its_own_rows():
    batch, _ = _batch()
    part = select_rows(batch, torch.tensor([3, 0]))
    assert PROMPT_INPUTS not in part and "prompt_lengths" not in part
    width = part["input_ids"].shape[1]
    assert width == 5  # the longest selected row: 4 prompt tokens + 1
    assert torch.equal(part["pixel_values"], torch.cat([torch.full((2, 3), 2.0), torch.full((2, 3), 1.0)]))
    assert part["mm_token_type_ids"].tolist() == [[0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
    # the completion continues from the prompt's largest position, as the sampler decoded it
    assert part["position_ids"][:, 0].tolist() == [[0, 1, 2, 3, 4], [0, 0, 2, 3, 4], [0, 0, 2, 3, 4]]
    assert part["position_ids"][:, 1].tolist() == [[0, 1, 2, 3, 4], [0, 0, 2, 3, 4], [0, 0, 2, 3, 4]]
    empty = masked_rows(batch)
    assert empty["pixel_values"].shape == (2, 3) and bool((empty["labels"] == -100).all())


def test_a_checkpointed_rollout_keeps_its_prompt_inputs_as_data():
    batch, completions = _batch()
    rollout = Rollout(batch=batch, completions=completions, rewards=torch.zeros(2, 2), advantages=torch.zeros(2, 2))
    buffer = io.BytesIO()
    torch.save(rollout_state(rollout), buffer)
    buffer.seek(0)
    back = rollout_from_state(torch.load(buffer, weights_only=True))
    for key, value in select_rows(batch, torch.arange(4)).items():
        assert torch.equal(select_rows(back.batch, torch.arange(4))[key], value), key


def test_suppressed_tokens_are_never_drawn_at_any_temperature():
    """A vision-language policy's picture placeholders: the most likely token here, and still never chosen."""
    from twinkle_rl.samplers.processing import choose_tokens, process_logits

    from twinkle_core.sampling import SamplingParams

    logits = torch.tensor([[0.0, 5.0, 1.0, 0.5]]).repeat(64, 1)
    for temperature in (0.0, 1.0, 3.0):
        params = SamplingParams(temperature=temperature, suppress_token_ids=(1,))
        logprobs = process_logits(logits, params)
        assert bool(torch.isinf(logprobs[:, 1]).all())
        assert float(torch.logsumexp(logprobs[0], dim=-1)) == pytest.approx(0.0, abs=1e-6)
        generators = [torch.Generator().manual_seed(i) for i in range(64)]
        chosen, _ = choose_tokens(logprobs, generators, greedy=temperature == 0)
        assert 1 not in chosen.tolist()
