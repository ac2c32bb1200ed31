"""The ``vlm_grpo`` task: prompts that show pictures -> completions sampled with the pictures and Qwen-VL's 3-D RoPE
positions -> a GRPO step. Checked against plain transformers forwards that compute their own positions (the
model's ``get_rope_index``) from the processor's outputs: the sampler's log-probabilities, and the loss and every
gradient of a GRPO step written out here."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from twinkle_vlm.families import FAMILIES, part_of

from twinkle_core.errors import ConfigError
from twinkle_core.testing.tolerance import forward_tolerance, max_abs_diff

pytest.importorskip("twinkle_rl")

from twinkle_rl.prompts import collate_prompts  # noqa: E402
from twinkle_vlm.online import VLMOnlineRLTask  # noqa: E402

QWEN = FAMILIES["qwen2_5_vl"]
FULL = {"train_vision": "full", "train_projector": "full", "train_language": "full"}
#: a dense reward of the completion text, so that a random model's completions of one prompt score differently
REWARD = "twinkle_vlm.testing:character_share"
#: pictures of 56 x 56 to 84 x 84 pixels: 2 x 2 to 3 x 3 merged image tokens, whose 3-D positions run behind the
#: token count (the text after a picture continues from the largest position, not from the number of tokens)
PIXELS = {"min_pixels": 56 * 56, "max_pixels": 84 * 84}


@pytest.fixture(scope="module")
def picture_rows(tmp_path_factory):
    """Prompt-only rows (the reference in ``answer``) and one SFT-style row, with pictures of several sizes: the
    larger ones become several merged tokens per side, so their 3-D positions differ from 1-D ones."""
    directory = tmp_path_factory.mktemp("online-images")
    rows = []
    for i, (name, size, rgb) in enumerate([("red", (56, 84), (220, 30, 30)), ("green", (84, 56), (30, 200, 30)),
                                           ("blue", (28, 30), (30, 30, 220)), ("white", (112, 56), (250, 250, 250))]):
        path = directory / f"{name}.png"
        Image.new("RGB", size, rgb).save(path)
        user = {"role": "user", "content": [{"type": "image", "image": str(path)},
                                            {"type": "text", "text": "What colour is this?" if i % 2 else "Colour?"}]}
        if i == 3:  # an SFT row: its last assistant turn is the reference
            rows.append({"messages": [user, {"role": "assistant", "content": name}]})
        else:
            rows.append({"messages": [user], "answer": name})
    return rows


@pytest.fixture(scope="module")
def video_rows(tmp_path_factory):
    """Prompts that show a clip (a folder of frames: two temporal patches of 56 x 56 pixels each)."""
    directory = tmp_path_factory.mktemp("online-videos")
    rows = []
    for i, (last, colours) in enumerate([("blue", [(200, 30, 30)] * 2 + [(30, 30, 200)] * 2),
                                         ("red", [(30, 200, 30)] * 2 + [(200, 30, 30)] * 2)]):
        frames = directory / f"clip{i}"
        frames.mkdir()
        for k, rgb in enumerate(colours):
            Image.new("RGB", (56, 56), rgb).save(frames / f"frame_{k:03d}.png")
        rows.append({"messages": [{"role": "user", "content": [{"type": "video", "video": str(frames)},
                                                               {"type": "text", "text": "Which colour comes last?"}]}],
                     "answer": last})
    return rows


@pytest.fixture(params=["images", "video"])
def prompt_rows(request, picture_rows, video_rows):
    return picture_rows if request.param == "images" else video_rows


def _model(model_dir, *, task_options=None, adapter=None, loss="grpo"):
    from twinkle_backend_hf.model import TransformersModel

    options = {"num_generations": 2, "rewards": [REWARD], "sampling": {"max_new_tokens": 6}, **PIXELS,
               **(task_options or {})}
    task = VLMOnlineRLTask(**options)
    tokenizer = TransformersModel.load_tokenizer(str(model_dir))
    model = TransformersModel(model_id=str(model_dir), task=task, tokenizer=tokenizer)
    task.prepare_model(model)
    name = None
    if adapter is not None:
        name = "default"
        model.add_adapter_to_model(name, adapter)
    model.set_loss(loss, adapter_name=name, **task.loss_options(loss))
    model.set_optimizer("SGD", adapter_name=name, lr=0.5)
    return model, task


def _features(task, model, rows):
    features = task.load_dataset(rows, model.tokenizer)
    return task.prepare_dataset(model, features, split="train", output_dir="unused")


def _plain(model_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def _plain_logps(network, feature, completion_ids):
    """Log-probabilities of ``completion_ids`` after ``feature``'s prompt from one plain transformers forward that
    computes its own positions (no ``position_ids``) from the prompt's pictures."""
    ids = torch.tensor([feature.prompt_ids + list(completion_ids)])
    types = torch.zeros_like(ids)
    types[0, :len(feature.prompt_ids)] = feature.inputs.token_values["mm_token_type_ids"]
    logits = network(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                     **feature.inputs.tensors).logits[0].float()
    start = len(feature.prompt_ids)
    steps = torch.log_softmax(logits[start - 1:ids.shape[1] - 1], dim=-1)
    return steps.gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]


def _bounds(network):
    text = network.config.text_config
    width = max(text.vocab_size, text.intermediate_size, text.hidden_size)
    return width, text.num_hidden_layers + network.config.vision_config.depth


# ---------------------------------------------------------------------- prompts
def test_prompt_rows_carry_their_pictures_and_their_own_3d_positions(tiny_vlm_dir, picture_rows):
    model_dir = tiny_vlm_dir("qwen2_5_vl")
    model, task = _model(model_dir)
    features = _features(task, model, picture_rows)
    assert [f.fields["answer"] for f in features] == ["red", "green", "blue", "white"]
    placeholders = {model.tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>",
                                                                       "<|vision_start|>", "<|vision_end|>")}
    assert placeholders <= set(task.params.suppress_token_ids)  # a completion cannot show a picture
    plain = _plain(model_dir)
    image_token = model.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assistant = model.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    grids = []
    for feature in features:
        assert feature.prompt_ids[-len(assistant):] == assistant  # the generation prompt ends the prompt
        assert image_token in feature.prompt_ids
        inputs = feature.inputs
        ids = torch.tensor([feature.prompt_ids])
        want, _ = plain.model.get_rope_index(input_ids=ids, mm_token_type_ids=inputs.token_values["mm_token_type_ids"][None],
                                             image_grid_thw=inputs.tensors["image_grid_thw"],
                                             attention_mask=torch.ones_like(ids))
        assert torch.equal(inputs.position_ids, want[:, 0])
        grids.append(inputs.tensors["image_grid_thw"].tolist())
    # the pictures are several merged tokens wide and high: the positions after them run behind the token count
    assert all(int(f.inputs.position_ids.max()) + 1 < len(f.prompt_ids) for f in features), grids


def test_options_that_would_cut_a_picture_or_need_an_environment_are_refused():
    with pytest.raises(ConfigError, match="prompt_over_length"):
        VLMOnlineRLTask(rewards=[REWARD], prompt_over_length="truncate_left")
    with pytest.raises(ConfigError, match="text only"):
        VLMOnlineRLTask(rewards=[REWARD], environment={"name": "calculator"})


def test_the_recipe_check_knows_every_vlm_option():
    from twinkle_vlm.preference import VLM_OPTIONS

    from twinkle_core.options import accepted_options

    accepted = accepted_options(VLMOnlineRLTask)
    assert VLM_OPTIONS | {"num_generations", "rewards", "sampling"} <= accepted.names
    assert not accepted.open or "train_vision" in accepted.names


def test_a_sampler_without_prompt_inputs_is_refused_by_name(tiny_vlm_dir, picture_rows):
    from twinkle_core.sampling import Completion, Sampler, SamplingParams, sample_prompts

    class TokensOnly(Sampler):
        name = "tokens_only"

        def sample(self, prompts, *, n, params, seeds):
            return [[Completion([1], [0.0], "length") for _ in range(n)] for _ in prompts]

    model, task = _model(tiny_vlm_dir("qwen2_5_vl"))
    features = _features(task, model, picture_rows[:1])
    with pytest.raises(ConfigError, match="tokens_only.*hf_generate"):
        sample_prompts(TokensOnly(), [features[0].prompt_ids], n=1, params=SamplingParams(), seeds=[[0]],
                       inputs=[features[0].inputs])


# ---------------------------------------------------------------------- sampling
def test_sampled_log_probs_equal_a_plain_forward_over_the_processor_output(tiny_vlm_dir, prompt_rows):
    """Prompts of several lengths decode in one left-padded batch; each completion's log-probabilities (the
    behaviour policy's, at temperature 1) equal one plain forward over prompt + completion with the prompt's
    pictures, in which transformers computes the 3-D positions itself. Wrong decoding positions (1-D positions,
    or not continued from the prompt's largest) change them by far more than the bound."""
    from twinkle_rl.samplers.hf_generate import HFGenerateSampler

    from twinkle_core.sampling import SamplingParams

    model_dir = tiny_vlm_dir("qwen2_5_vl")
    model, task = _model(model_dir)
    features = _features(task, model, prompt_rows)
    if len(features) > 2:
        assert len({len(f.prompt_ids) for f in features}) > 1  # left padding is exercised
    sampler = HFGenerateSampler()
    sampler.bind(model, model.tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    seeds = [[7 * i, 7 * i + 1] for i in range(len(features))]
    groups = sampler.sample([f.prompt_ids for f in features], n=2, params=params, seeds=seeds,
                            inputs=[f.inputs for f in features])
    plain = _plain(model_dir)
    width, depth = _bounds(plain)
    checked = 0
    with torch.no_grad():
        for feature, group in zip(features, groups, strict=True):
            for completion in group:
                want = _plain_logps(plain, feature, completion.token_ids)
                got = torch.tensor(completion.logprobs)
                bound = forward_tolerance(float(want.abs().max()) + 1.0, width=width, depth=depth)
                assert max_abs_diff(got, want) <= bound, (feature.fields, got, want, bound)
                checked += len(completion.token_ids)
    assert checked >= 4 * len(features)


# ---------------------------------------------------------------------- a GRPO step
def _grpo_reference(network, features, batch, epsilon=0.2):
    """GRPO written out: per-sequence token means of ``-min(r A, clip(r) A)`` with ``r = exp(logp - old_logp)``,
    summed over the sequences and divided by their number. Row ``s`` of the batch is completion ``s % n`` of
    prompt ``s // n``; its completion is its labelled tokens, its behaviour log-probs the batch's ``old_logps``."""
    rows = batch["input_ids"].shape[0]
    n = rows // len(features)
    total = torch.zeros(())
    for s in range(rows):
        feature = features[s // n]
        trained = batch["labels"][s] != -100
        completion = batch["input_ids"][s][trained].tolist()
        assert batch["input_ids"][s, :len(feature.prompt_ids)].tolist() == feature.prompt_ids
        logps = _plain_logps(network, feature, completion)
        old = batch["old_logps"][s][trained[1:]]
        advantage = float(batch["advantages"][s])
        ratio = torch.exp(logps - old)
        per_token = -torch.minimum(ratio * advantage, ratio.clamp(1 - epsilon, 1 + epsilon) * advantage)
        total = total + per_token.mean()
    return total / rows


def test_a_grpo_step_equals_the_per_sequence_computation(tiny_vlm_dir, prompt_rows):
    """The training rows carry each prompt's pictures (concatenated in row order) and the positions their
    completion was sampled at; the loss and every gradient (vision, projector, language) equal GRPO written out
    over plain transformers forwards."""
    model_dir = tiny_vlm_dir("qwen2_5_vl")
    model, task = _model(model_dir, task_options=FULL)
    features = _features(task, model, prompt_rows)
    batch = task.next_training_batch(model, lambda: collate_prompts(features))
    rows = 2 * len(features)
    assert batch["position_ids"].shape[:2] == (3, rows)
    grid = "image_grid_thw" if "image_grid_thw" in batch else "video_grid_thw"
    assert batch[grid].shape[0] == rows  # each of the 2 completions of a prompt has its own copy
    assert bool(batch["advantages"].abs().sum() > 0), "the reward must tell the completions of a prompt apart"
    loss = float(model.forward_backward(inputs=batch)["loss"])
    grads = {n: p.grad.detach().clone() for n, p in model.module.named_parameters() if p.grad is not None}

    plain = _plain(model_dir)
    want = _grpo_reference(plain, features, batch)
    want.backward()
    width, depth = _bounds(plain)
    tolerance = forward_tolerance(float(batch["advantages"].abs().max()) + 1.0, width=width, depth=depth)
    assert abs(loss - float(want)) <= tolerance, (loss, float(want), tolerance)
    named = dict(plain.named_parameters())
    assert {part_of(n, QWEN) for n in grads} == {"vision", "projector", "language"}
    for name, grad in grads.items():
        expected = named[name].grad
        bound = forward_tolerance(float(expected.abs().sum()) + 1e-12, width=width, depth=depth)
        assert max_abs_diff(grad, expected) <= bound, name


def test_lora_language_and_frozen_vision_apply(tiny_vlm_dir, picture_rows):
    model, task = _model(tiny_vlm_dir("qwen2_5_vl"), task_options={"train_vision": "frozen"},
                         adapter={"type": "lora", "r": 4, "lora_alpha": 8})
    features = _features(task, model, picture_rows)
    batch = task.next_training_batch(model, lambda: collate_prompts(features))
    model.forward_backward(inputs=batch, adapter_name="default")
    with_grad = {n for n, p in model.module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {part_of(n, QWEN) for n in with_grad} == {"projector", "language"}
    assert all("lora_" in n for n in with_grad if part_of(n, QWEN) == "language")


def test_held_out_evaluation_samples_with_the_pictures(tiny_vlm_dir, picture_rows):
    model, task = _model(tiny_vlm_dir("qwen2_5_vl"),
                         task_options={"rewards": [{"name": "exact_match", "options": {"field": "answer"}}]})
    features = _features(task, model, picture_rows)
    result = task.evaluate(model, features, model.tokenizer)
    assert result["num_examples"] == 4 and 0.0 <= result["accuracy"] <= 1.0
