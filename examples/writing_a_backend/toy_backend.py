"""A toy backend: a third-party ``TwinkleModel`` built on the core's public backend protocol.

``TorchTwinkleModel`` implements the whole training API once (losses, gradient accumulation, optimizers,
checkpoints, metrics, adapters' bookkeeping, strategies and precision); a backend supplies only its network
and how it is run, given adapters, and written to / read from disk. This one is a tiny causal network
(prefix-mean of embeddings, a residual MLP, an LM head) with hand-written LoRA, and passes the core's
conformance suite unchanged:

    pytest --pyargs twinkle_core.testing.conformance --twinkle-backend toy

It registers like every other plugin (entry point group ``twinkle``).
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from twinkle_core import hookimpl
from twinkle_core.errors import ConfigError
from twinkle_core.model.torch_model import TorchTwinkleModel
from twinkle_core.records import ConformanceTarget, ModelRecord


class LoraLinear(nn.Module):
    """A linear layer with named low-rank adapters; ``active`` picks the one applied (``None``: the base)."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base, self.lora_A, self.lora_B = base, nn.ParameterDict(), nn.ParameterDict()
        self.scaling: dict[str, float] = {}
        self.active: str | None = None

    def add(self, name: str, r: int, alpha: float, random_b: bool) -> None:
        self.lora_A[name] = nn.Parameter(torch.randn(r, self.base.in_features) / r)
        self.lora_B[name] = nn.Parameter(torch.randn(self.base.out_features, r) / r if random_b
                                         else torch.zeros(self.base.out_features, r))
        self.scaling[name] = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.active in self.lora_A:
            out = out + x @ self.lora_A[self.active].T @ self.lora_B[self.active].T * self.scaling[self.active]
        return out


class PrefixMeanLM(nn.Module):
    """Causal: position t sees the mean of the embeddings of tokens 0..t (of its own row, masked)."""

    def __init__(self, vocab_size: int = 64, hidden_size: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.up, self.down = nn.Linear(hidden_size, 2 * hidden_size), nn.Linear(2 * hidden_size, hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, **unused):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        x = self.embed(input_ids) * mask.unsqueeze(-1)
        h = x.cumsum(dim=1) / mask.cumsum(dim=1).clamp(min=1).unsqueeze(-1)
        h = h + self.down(torch.relu(self.up(h)))
        return {"logits": self.lm_head(h)}


class ToyModel(TorchTwinkleModel):
    supported_model_kinds = ("causal_lm",)

    def __init__(self, *, vocab_size: int = 64, hidden_size: int = 32, **kwargs) -> None:
        self.sizes = {"vocab_size": vocab_size, "hidden_size": hidden_size}
        super().__init__(**kwargs)

    # build and run ---------------------------------------------------------------------------------------
    def build_network(self) -> nn.Module:
        return PrefixMeanLM(**self.sizes)

    def generation_module(self, *, adapter_name=None):
        # the contract allows refusing: a sampler then builds its own copy from get_state_dict()
        raise ConfigError("ToyModel keeps no KV cache, so it cannot lend its network to an in-process sampler; "
                          "use a sampler with weight_sync='push'")

    # adapters ---------------------------------------------------------------------------------------------
    def lora_layers(self) -> list[LoraLinear]:
        return [m for m in self.module.modules() if isinstance(m, LoraLinear)]

    def attach_adapter(self, adapter_name, config, **kwargs) -> None:
        if dict(config).get("type", "lora") != "lora":
            raise ConfigError(f"ToyModel supports LoRA adapters only, got {config!r}")
        if not self.lora_layers():
            self.module.up, self.module.down = LoraLinear(self.module.up), LoraLinear(self.module.down)
        for layer in self.lora_layers():
            layer.add(adapter_name, int(config.get("r", 4)), float(config.get("lora_alpha", 8)),
                      random_b=config.get("init_lora_weights", True) is False)
        for name, parameter in self.module.named_parameters():
            parameter.requires_grad_(".lora_" in name)  # adapters train, the base is frozen
        self.module.to(self.device)

    def detach_adapter(self, adapter_name) -> None:
        for layer in self.lora_layers():
            del layer.lora_A[adapter_name], layer.lora_B[adapter_name], layer.scaling[adapter_name]

    @contextlib.contextmanager
    def activate_adapter(self, adapter_name):
        for layer in self.lora_layers():
            layer.active = adapter_name
        try:
            yield
        finally:
            for layer in self.lora_layers():
                layer.active = None

    def deactivate_adapters(self):
        return self.activate_adapter(None)

    def adapter_parameter_names(self, adapter_name) -> list[str]:
        return [n for n, _ in self.module.named_parameters() if n.endswith((f"lora_A.{adapter_name}",
                                                                             f"lora_B.{adapter_name}"))]

    # weights in and out ------------------------------------------------------------------------------------
    def write_weights(self, directory, state_dict, adapter_name) -> None:
        name = "adapter.safetensors" if adapter_name else "model.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, os.path.join(directory, name))
        with open(os.path.join(directory, "toy_config.json"), "w") as f:
            json.dump(self.sizes, f)

    def read_weights(self, directory, adapter_name) -> dict[str, torch.Tensor]:
        return load_file(os.path.join(directory, "adapter.safetensors" if adapter_name else "model.safetensors"))

    def describe(self) -> dict:
        return {"class": type(self).__name__, **self.sizes}


def make_toy_model(*, seed: int = 0, **options) -> ToyModel:
    """The conformance factory: a tiny model with the suite's 64-token vocabulary."""
    return ToyModel(seed=seed, **options)


@hookimpl
def twinkle_register_models():
    yield ModelRecord("ToyModel", "toy_backend:ToyModel")


@hookimpl
def twinkle_register_conformance_targets():
    yield ConformanceTarget("toy", "toy_backend:make_toy_model")
