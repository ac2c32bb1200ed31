"""Vision-language models (the ``image_text_to_text`` kind, Qwen2.5-VL) on megatron-core.

The network (:class:`MegatronVLM`) is laid out as Hugging Face's ``Qwen2_5_VLForConditionalGeneration``:

* ``model.visual`` -- the Hugging Face vision tower with its merger (the projector), unchanged and replicated on
  every tensor-parallel rank: every rank computes the same image features (a few percent of the work of a
  real model's language side), and their gradients come out equal on every rank because the first tensor-parallel
  layer all-reduces the gradient of its input (``copy_to_tensor_model_parallel_region``);
* ``model.language_model`` -- megatron-core's ``GPTModel`` built from the text config, with its multimodal rotary
  embedding (``position_embedding_type="mrope"``): ``MultimodalRotaryEmbedding`` splits the rotary channels by
  ``mrope_section`` over the temporal / height / width positions exactly as transformers'
  ``Qwen2_5_VLRotaryEmbedding`` does, so the task's ``[3, batch, seq]`` positions pass unchanged (``[4, ...]``
  for packed rows: row 0 only says where each sample starts, as in transformers).

The forward embeds the tokens with Megatron's vocabulary-parallel embedding, puts the vision tower's outputs at the
image-token positions and hands the result to the ``GPTModel`` as its ``decoder_input``. Under pipeline parallelism
the tower lives on the first stage only; megatron-core's schedule runs the ``GPTModel`` chunk (whose ``config`` and
``set_input_tensor`` it reads) through this forward, on micro-batches that carry the images of their rows
(:func:`split_vision_batch`) and the 3-D positions every stage's rotary embedding needs. The parameter names are
Hugging Face's (``model.visual.*``, ``model.language_model.*``), so the vlm task's part plan (``train_vision`` /
``train_projector`` / ``train_language``) and its RoPE index (``get_rope_index``) find what they look for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from twinkle_backend_megatron import convert
from twinkle_backend_megatron.forward import megatron_inputs
from twinkle_backend_megatron.kinds import TextNetwork
from twinkle_backend_megatron.pipeline import split_rows
from twinkle_backend_megatron.weights import ShardedWeights, gather_over_pipeline
from twinkle_core.errors import ConfigError

#: model_type -> (the transformers model class whose ``get_rope_index`` computes the positions, its vision tower)
FAMILIES = {"qwen2_5_vl": ("Qwen2_5_VLModel", "Qwen2_5_VisionTransformerPretrainedModel")}
LANGUAGE = "model.language_model."
VISION = "model.visual."


def hf_language_key(key: str) -> str:
    """A causal-LM Hugging Face name (``convert.py``'s) as the vision-language model names it in memory."""
    return LANGUAGE + key.removeprefix("model.") if key.startswith("model.") else key


def checkpoint_key(key: str) -> str:
    """An in-memory name as checkpoint files name it (transformers writes Qwen2.5-VL files in the original
    layout, ``model.layers.*`` / ``visual.*``, and renames them on loading)."""
    if key.startswith(LANGUAGE):
        return "model." + key.removeprefix(LANGUAGE)
    return key.removeprefix("model.") if key.startswith(VISION) else key


def either_layout(get: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """``get`` by in-memory name (a state dict) or, where it has none, by checkpoint-file name."""
    def lookup(key: str) -> torch.Tensor:
        try:
            return get(key)
        except KeyError:
            return get(checkpoint_key(key))
    return lookup


def _family(hf_config: Any) -> tuple[Any, Any]:
    import transformers

    names = FAMILIES.get(getattr(hf_config, "model_type", None))
    if names is None:
        raise ConfigError(f"MegatronModel builds vision-language models of type {', '.join(FAMILIES)}; got "
                          f"{getattr(hf_config, 'model_type', None)!r}: use TransformersModel for it")
    return getattr(transformers, names[0]), getattr(transformers, names[1])


class MegatronVLM(torch.nn.Module):
    """The vision tower and the ``GPTModel`` (see the module doc); ``config`` is the Hugging Face config."""

    def __init__(self, config: Any, visual: torch.nn.Module, language: torch.nn.Module) -> None:
        super().__init__()
        self.config = config
        self.hf_model_class = _family(config)[0]
        self.model = torch.nn.Module()
        self.model.visual = visual
        self.model.language_model = language

    # the vlm task computes the 3-D positions with the model's own get_rope_index (twinkle_vlm.packing); the
    # transformers methods read only ``self.config`` and each other
    def get_rope_index(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf_model_class.get_rope_index(self, *args, **kwargs)

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf_model_class.get_vision_position_ids(self, *args, **kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, **others: Any) -> torch.Tensor:
        if others.get("pixel_values_videos") is not None:
            raise ConfigError("MegatronModel trains vision-language models on images only; for videos use "
                              "TransformersModel")
        sample_starts, positions = split_positions(input_ids, position_ids)
        mask = megatron_inputs({"input_ids": input_ids, "attention_mask": attention_mask,
                                "position_ids": sample_starts})["attention_mask"]
        language = self.model.language_model
        embeds = None  # a later pipeline stage starts from the previous stage's output (the schedule sets it)
        if language.pre_process:
            embeds = language.embedding(input_ids=input_ids, position_ids=None)  # [s, b, h]
            if pixel_values is not None:
                embeds = self.with_images(embeds, input_ids, pixel_values, image_grid_thw)
        return language(input_ids=input_ids, position_ids=positions, attention_mask=mask, decoder_input=embeds)

    def with_images(self, embeds: torch.Tensor, input_ids: torch.Tensor, pixel_values: torch.Tensor,
                    image_grid_thw: torch.Tensor) -> torch.Tensor:
        """``embeds`` ([s, b, h]) with the image features at the image tokens, in row-major order (as the
        processor laid the images out and transformers' ``masked_scatter`` places them)."""
        visual = self.model.visual
        features = visual(pixel_values.to(visual.dtype), grid_thw=image_grid_thw).pooler_output
        image = input_ids == self.config.image_token_id
        if int(image.sum()) != features.shape[0]:
            raise ValueError(f"the batch has {int(image.sum())} image tokens but its images give {features.shape[0]} "
                             f"features: collate pixel_values / image_grid_thw with the input_ids they belong to")
        rows = embeds.transpose(0, 1).masked_scatter(image[..., None], features.to(embeds.dtype))
        return rows.transpose(0, 1).contiguous()


def split_positions(input_ids: torch.Tensor, position_ids: torch.Tensor | None
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(text positions of packed rows or None, [3, b, s] rotary positions)`` from the task's positions: none
    (text only), ``[b, s]``, ``[3, b, s]`` or packed ``[4, b, s]`` (row 0: the per-sample text positions)."""
    if position_ids is None:
        b, s = input_ids.shape
        return None, torch.arange(s, device=input_ids.device).expand(3, b, s)
    if position_ids.dim() == 2:
        return position_ids, position_ids[None].expand(3, *position_ids.shape)
    if position_ids.shape[0] == 4:
        return position_ids[0], position_ids[1:]
    return None, position_ids


def split_vision_batch(config: Any, inputs: dict[str, Any], micro: int) -> list[dict[str, Any]]:
    """``inputs`` cut into ``micro`` pipeline micro-batches of rows, each with the images its rows show: the images
    are laid out row-major (as the processor and ``masked_scatter`` place them), ``image_grid_thw`` one row per
    image and ``pixel_values`` ``t * h * w`` patch rows per image; the positions are ``[3 or 4, rows, seq]``."""
    images = {k: inputs.pop(k) for k in ("pixel_values", "image_grid_thw") if inputs.get(k) is not None}
    positions = inputs.pop("position_ids", None)
    pieces = split_rows(inputs, micro)
    rows = inputs["input_ids"].shape[0] // micro
    if positions is not None and positions.dim() == 3:
        for i, piece in enumerate(pieces):
            piece["position_ids"] = positions[:, i * rows:(i + 1) * rows]
    elif positions is not None:
        for i, piece in enumerate(pieces):
            piece["position_ids"] = positions[i * rows:(i + 1) * rows]
    if not images:
        return pieces
    grid = images["image_grid_thw"]
    merged = (grid.prod(-1) // config.vision_config.spatial_merge_size ** 2).tolist()  # image tokens per image
    patches = [0, *grid.prod(-1).cumsum(0).tolist()]
    first = 0
    for piece in pieces:
        tokens, last = int((piece["input_ids"] == config.image_token_id).sum()), first
        while tokens > 0:
            tokens -= merged[last]
            last += 1
        if tokens:
            raise ValueError("a micro-batch's image tokens do not end at an image boundary: each image's tokens must "
                             "lie in one row")
        piece["image_grid_thw"] = grid[first:last]
        piece["pixel_values"] = images["pixel_values"][patches[first]:patches[last]]
        first = last
    return pieces


class VLMWeights:
    """:class:`~twinkle_backend_megatron.weights.ShardedWeights` of the language model under the vision-language
    names, plus the vision tower's own (replicated) weights."""

    def __init__(self, network: MegatronVLM, spec: convert.ModelSpec, mesh: Any) -> None:
        self.visual = network.model.visual  # None on the later pipeline stages
        self.language = ShardedWeights([network.model.language_model], spec, mesh)
        self.pp = mesh.pp

    def local_state(self, get: Callable[[str], torch.Tensor], *, fused_experts: bool) -> dict[str, torch.Tensor]:
        get = either_layout(get)
        language = self.language.local_state(lambda key: get(hf_language_key(key)), fused_experts=fused_experts)
        state = {LANGUAGE + name: tensor for name, tensor in language.items()}
        for name, tensor in self._vision_state().items():
            state[VISION + name] = get(VISION + name).to(tensor.dtype)
        return state

    def _vision_state(self) -> dict[str, torch.Tensor]:
        return self.visual.state_dict() if self.visual is not None else {}

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        out = {hf_language_key(key): tensor for key, tensor in self.language.hf_state_dict().items()}
        vision = {VISION + name: tensor.detach().cpu().clone() for name, tensor in self._vision_state().items()}
        out.update(gather_over_pipeline(vision, self.pp))  # the tower lives on the first stage
        return dict(sorted(out.items()))


class VisionLanguageNetwork(TextNetwork):
    """``image_text_to_text``: :class:`MegatronVLM` (see the module doc)."""

    name = "image_text_to_text"

    def language_config(self, hf_config: Any) -> Any:
        _family(hf_config)
        return hf_config.text_config

    def spec(self, hf_config: Any, tp_size: int) -> convert.ModelSpec:
        # the text config of a VLM does not carry tie_word_embeddings: the model's config does
        spec = convert.model_spec(hf_config.text_config, tp_size)
        return dataclasses.replace(spec, tied=bool(getattr(hf_config, "tie_word_embeddings", False)))

    def init_state(self, hf_config: Any, trust_remote_code: bool) -> dict[str, torch.Tensor]:
        import transformers

        hf = transformers.AutoModelForImageTextToText.from_config(hf_config, dtype=torch.float32,
                                                                  trust_remote_code=trust_remote_code)
        return {k: v.detach() for k, v in hf.state_dict().items()}

    def rotary(self, language_config: Any) -> dict[str, Any]:
        params = getattr(language_config, "rope_parameters", None) or getattr(language_config, "rope_scaling", None)
        section = (params or {}).get("mrope_section")
        if not section:
            raise ConfigError(f"the text config of {language_config.model_type} has no rope mrope_section: "
                              f"MegatronModel runs Qwen-VL's multimodal RoPE only")
        return {"position_embedding_type": "mrope", "mrope_section": list(section)}

    def check_layout(self, mesh: Any, options: Any) -> None:
        # the schedule runs the GPTModel chunk (megatron-core reads ``.config`` and ``set_input_tensor`` off it) and
        # this network's forward through stage_runner; with several chunks per rank it would need one per chunk
        refused = {"mesh.vpp > 1 (virtual pipeline stages)": mesh.vpp > 1,
                   "mesh.cp > 1": mesh.cp > 1,
                   "strategy.options.sequence_parallel (the image features are placed before the sequence is split)":
                       bool(options["sequence_parallel"]),
                   "strategy.options.distributed_optimizer": bool(options["distributed_optimizer"])}
        for what, present in refused.items():
            if present:
                raise ConfigError(f"MegatronModel does not run vision-language models with {what} yet; use tensor "
                                  f"and data parallelism, or TransformersModel")

    def assemble(self, language: torch.nn.Module, hf_config: Any) -> torch.nn.Module:
        visual = None  # the tower feeds the embeddings: on the first pipeline stage only
        if language.pre_process:
            visual = _family(hf_config)[1]._from_config(hf_config.vision_config, dtype=torch.float32)
        return MegatronVLM(hf_config, visual, language)

    def language(self, network: torch.nn.Module) -> torch.nn.Module:
        return network.model.language_model

    def weights(self, network: torch.nn.Module, spec: convert.ModelSpec, mesh: Any) -> VLMWeights:
        return VLMWeights(network, spec, mesh)

    def run(self, module: torch.nn.Module, inputs: dict[str, Any], unwrap: Any) -> torch.Tensor:
        return unwrap(module)(**inputs)

    def stage_runner(self, network: torch.nn.Module) -> Any:
        # the one GPTModel chunk of this rank runs inside the network, after the tower on the first stage
        return lambda chunk, batch, unwrap: unwrap(network)(**batch)

    def splitter(self, network: torch.nn.Module) -> Any:
        return lambda inputs, micro: split_vision_batch(network.config, dict(inputs), micro)

    def check_adapter(self) -> None:
        raise ConfigError("LoRA adapters on a vision-language MegatronModel are not supported yet: set "
                          "task_options.train_language: full (and no model.adapter), or use TransformersModel")

    def auto_class(self) -> str:
        return "AutoModelForImageTextToText"

    def file_key(self, key: str) -> str:
        return checkpoint_key(key)  # the layout transformers itself writes (and other tools read)


__all__ = ["FAMILIES", "MegatronVLM", "VLMWeights", "VisionLanguageNetwork", "checkpoint_key", "either_layout",
           "hf_language_key", "split_positions", "split_vision_batch"]
