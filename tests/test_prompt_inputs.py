"""The layout of prompt inputs (a vision-language prompt's per-token values, positions and pictures) for a batch:
the same rule for a sampler's left-padded prefill and for right-padded training rows."""

from __future__ import annotations

import io

import pytest
import torch

from twinkle_core.errors import ConfigError
from twinkle_core.prompt_inputs import PromptInputs, batch_prompt_inputs, next_positions
from twinkle_core.sampling import Completion, Sampler, SamplingParams, sample_prompts

#: a prompt of 5 tokens whose picture (tokens 1-3) sits on a 2-D grid: its positions run behind the token count
PICTURE = PromptInputs(token_values={"types": torch.tensor([0, 1, 1, 1, 0])},
                       position_ids=torch.tensor([[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]]),
                       tensors={"pixels": torch.ones(3, 2)})


def test_left_padding_puts_each_prompt_at_the_right_and_decoding_continues_from_its_largest_position():
    text = PromptInputs(tensors={"pixels": torch.zeros(1, 2)})
    out = batch_prompt_inputs([PICTURE, text, None], starts=[1, 3, 4], lengths=[5, 3, 2], width=6)
    assert out["types"].tolist() == [[0, 0, 1, 1, 1, 0], [0] * 6, [0] * 6]
    assert out["position_ids"].shape == (3, 3, 6)
    assert out["position_ids"][:, 0].tolist() == [[0, 0, 1, 1, 1, 3], [0, 0, 1, 1, 2, 3], [0, 0, 1, 2, 1, 3]]
    assert out["position_ids"][:, 1].tolist() == [[0, 0, 0, 0, 1, 2]] * 3  # a text prompt counts in every dimension
    assert out["position_ids"][:, 2].tolist() == [[0, 0, 0, 0, 0, 1]] * 3
    assert torch.equal(out["pixels"], torch.cat([torch.ones(3, 2), torch.zeros(1, 2)]))  # row order
    assert next_positions(out["position_ids"])[:, :, 0].tolist() == [[4, 3, 2]] * 3


def test_right_padded_training_rows_continue_where_the_sampler_continued():
    out = batch_prompt_inputs([PICTURE], starts=[0], lengths=[5], width=8)
    assert out["position_ids"][:, 0].tolist() == [[0, 1, 1, 1, 3, 4, 5, 6], [0, 1, 1, 2, 3, 4, 5, 6],
                                                  [0, 1, 2, 1, 3, 4, 5, 6]]
    assert out["types"].tolist() == [[0, 1, 1, 1, 0, 0, 0, 0]]


def test_rows_without_inputs_give_nothing_and_bad_shapes_are_refused():
    assert batch_prompt_inputs([None, None], starts=[0, 0], lengths=[2, 3], width=3) == {}
    with pytest.raises(ValueError, match="one value per token"):
        PICTURE.check(4)
    flat = PromptInputs(position_ids=torch.arange(5)[None])
    with pytest.raises(ValueError, match="different dimensions"):
        batch_prompt_inputs([PICTURE, flat], starts=[0, 0], lengths=[5, 5], width=5)


def test_the_state_is_data_only():
    buffer = io.BytesIO()
    torch.save(PICTURE.state(), buffer)
    buffer.seek(0)
    back = PromptInputs.from_state(torch.load(buffer, weights_only=True))
    assert torch.equal(back.position_ids, PICTURE.position_ids)
    assert torch.equal(back.tensors["pixels"], PICTURE.tensors["pixels"])


class _Recording(Sampler):
    name = "recording"
    takes_prompt_inputs = True

    def sample(self, prompts, *, n, params, seeds, inputs=None):
        self.inputs = inputs
        return [[Completion([1], [0.0], "length") for _ in range(n)] for _ in prompts]


class _TokensOnly(Sampler):
    name = "tokens_only"

    def sample(self, prompts, *, n, params, seeds):  # written before prompt inputs existed
        return [[Completion([1], [0.0], "length") for _ in range(n)] for _ in prompts]


def test_sample_prompts_hands_inputs_only_to_a_sampler_that_takes_them():
    params = SamplingParams()
    assert sample_prompts(_TokensOnly(), [[1, 2]], n=1, params=params, seeds=[[0]], inputs=[None])
    recording = _Recording()
    sample_prompts(recording, [[1, 2, 3, 4, 5]], n=1, params=params, seeds=[[0]], inputs=[PICTURE])
    assert recording.inputs == [PICTURE]
    with pytest.raises(ConfigError, match="'tokens_only' samples from token ids only.*hf_generate"):
        sample_prompts(_TokensOnly(), [[1, 2, 3, 4, 5]], n=1, params=params, seeds=[[0]], inputs=[PICTURE])
