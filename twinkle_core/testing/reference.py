"""An in-memory reference backend: a tiny pure-torch causal transformer with hand-written LoRA.

It exists so that the conformance suite is proven before any real backend is installed, and it is
used only by the core's own tests (run the suite with
``--twinkle-backend twinkle_core.testing.reference:make_reference_model``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from twinkle_core.errors import ConfigError
from twinkle_core.model.base import TwinkleModel
from twinkle_core.model.torch_model import TorchTwinkleModel
from twinkle_core.testing.conformance_data import CONFORMANCE_VOCAB_SIZE


class LoRALinear(nn.Module):
    """``nn.Linear`` plus any number of named low-rank adapters, one active at a time."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        self.scaling: dict[str, float] = {}
        self.active: str | None = None

    def add(self, name: str, r: int, alpha: float, init_b: bool = False) -> None:
        """``init_b``: B random as well (PEFT's ``init_lora_weights=False``), so the adapter changes the output."""
        a = nn.Parameter(torch.empty(r, self.base.in_features))
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        self.lora_A[name] = a
        b = nn.Parameter(torch.zeros(self.base.out_features, r))
        if init_b:
            nn.init.kaiming_uniform_(b, a=math.sqrt(5))
        self.lora_B[name] = b
        self.scaling[name] = alpha / r

    def remove(self, name: str) -> None:
        del self.lora_A[name], self.lora_B[name], self.scaling[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.active is not None and self.active in self.lora_A:
            out = out + (x @ self.lora_A[self.active].T @ self.lora_B[self.active].T) * self.scaling[self.active]
        return out


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(hidden, hidden) for _ in range(4))
        self.norm2 = nn.LayerNorm(hidden)
        self.up_proj = nn.Linear(hidden, 2 * hidden)
        self.down_proj = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.norm1(x)
        q, k, v = (p(y).view(b, t, self.heads, h // self.heads).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(b, t, h))
        return x + self.down_proj(F.gelu(self.up_proj(self.norm2(x))))


class TinyCausalLM(nn.Module):
    def __init__(self, vocab_size: int = CONFORMANCE_VOCAB_SIZE, hidden_size: int = 32, num_layers: int = 2,
                 num_heads: int = 4, max_positions: int = 256) -> None:
        super().__init__()
        self.config = {"vocab_size": vocab_size, "hidden_size": hidden_size, "num_layers": num_layers,
                       "num_heads": num_heads, "max_positions": max_positions}
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.pos = nn.Embedding(max_positions, hidden_size)
        self.layers = nn.ModuleList(Block(hidden_size, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(t, device=input_ids.device).expand(b, t)
        # causal, and within one packed sequence (a new sequence starts where position_ids reset to 0)
        seq_id = torch.cumsum((position_ids == 0).long(), dim=-1)
        allowed = torch.tril(torch.ones(t, t, dtype=torch.bool, device=input_ids.device))
        allowed = allowed & (seq_id[:, :, None] == seq_id[:, None, :])
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        allowed = allowed | torch.eye(t, dtype=torch.bool, device=input_ids.device)  # padded rows stay finite
        x = self.embed(input_ids) + self.pos(position_ids)
        for layer in self.layers:
            x = layer(x, allowed[:, None])
        return {"logits": self.lm_head(self.norm(x))}


class ReferenceModel(TorchTwinkleModel):
    """``TwinkleModel`` over :class:`TinyCausalLM`; adapters are :class:`LoRALinear` layers."""

    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
    supported_model_kinds = ("causal_lm",)  # TinyCausalLM has an LM head only

    def generation_module(self, *, adapter_name: str | None = None) -> Any:
        # TinyCausalLM keeps no KV cache, so it cannot serve an in-process sampler (the contract allows refusing)
        return TwinkleModel.generation_module(self, adapter_name=adapter_name)

    def __init__(self, *, config: dict[str, Any] | None = None, model_id: str | None = None, **kwargs: Any) -> None:
        self.config = dict(config or {})
        self.model_id = model_id
        super().__init__(**kwargs)

    def build_network(self) -> nn.Module:
        module = TinyCausalLM(**self.config)
        if self.model_id:
            module.load_state_dict(self._read_safetensors(self.model_id))
        return module

    # -------------------------------------------------------------- adapters
    def lora_target_modules(self) -> dict[str, list[str]]:
        return {"attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["up_proj", "down_proj"],
                "unembed": ["lm_head"]}

    def _lora_layers(self) -> Iterator[tuple[str, LoRALinear]]:
        for name, mod in self.module.named_modules():
            if isinstance(mod, LoRALinear):
                yield name, mod

    def attach_adapter(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        config = dict(config)
        if config.get("type", "lora") != "lora":
            raise ConfigError(f"the reference backend supports only LoRA adapters, got {config.get('type')!r}")
        targets = config.get("target_modules", "all-linear")
        targets = self.lora_targets if targets == "all-linear" else tuple(targets)
        for mod in list(self.module.modules()):
            for child_name, child in list(mod.named_children()):
                if child_name in targets and isinstance(child, nn.Linear):
                    setattr(mod, child_name, LoRALinear(child))
        for _, layer in self._lora_layers():
            layer.add(adapter_name, int(config.get("r", 4)), float(config.get("lora_alpha", 8)),
                      init_b=config.get("init_lora_weights", True) is False)
        if not self.adapter_states.configs:  # first adapter: the base becomes frozen
            for name, p in self.module.named_parameters():
                p.requires_grad_(".lora_" in name)
        self.module.to(self.device)

    def detach_adapter(self, adapter_name: str) -> None:
        for _, layer in self._lora_layers():
            layer.remove(adapter_name)

    @contextlib.contextmanager
    def activate_adapter(self, adapter_name: str | None) -> Iterator[None]:
        layers = [layer for _, layer in self._lora_layers()]
        for layer in layers:
            layer.active = adapter_name
        try:
            yield
        finally:
            for layer in layers:
                layer.active = None

    def deactivate_adapters(self) -> contextlib.AbstractContextManager[None]:
        # no active adapter is the base model; every forward activates its adapter afresh
        return self.activate_adapter(None)

    def adapter_parameter_names(self, adapter_name: str) -> list[str]:
        return [n for n, _ in self.module.named_parameters()
                if n.endswith(f".lora_A.{adapter_name}") or n.endswith(f".lora_B.{adapter_name}")]

    # -------------------------------------------------------------- disk
    def write_weights(self, directory: str, state_dict: dict[str, torch.Tensor], adapter_name: str | None) -> None:
        from safetensors.torch import save_file

        filename = "adapter.safetensors" if adapter_name else "model.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
                  os.path.join(directory, filename))
        with open(os.path.join(directory, "config.json"), "w") as fh:
            json.dump({"model": self.module.config, "adapter": self.adapter_states.configs.get(adapter_name or "")}, fh)

    def read_weights(self, directory: str, adapter_name: str | None) -> dict[str, torch.Tensor]:
        return self._read_safetensors(directory, "adapter.safetensors" if adapter_name else "model.safetensors")

    @staticmethod
    def _read_safetensors(directory: str, filename: str = "model.safetensors") -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        return load_file(os.path.join(directory, filename))

    def describe(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "vocab_size": self.module.config["vocab_size"]}


def make_reference_model(*, seed: int = 0, **options: Any) -> ReferenceModel:
    """Conformance factory: a tiny reference model (vocab 64, hidden 32, 2 layers)."""
    return ReferenceModel(seed=seed, **options)
