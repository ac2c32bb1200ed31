"""The parts of a ``transformers`` / PEFT model that the Hugging Face backend's strategies act on: the base model
inside its wrappers, the transformer blocks to shard one by one, the PEFT adapters, and parameters made trainable
for as long as a wrapper or engine collects them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch


def base_model(module: torch.nn.Module) -> torch.nn.Module:
    """The ``transformers`` model inside PEFT / DDP wrappers."""
    while True:
        if hasattr(module, "get_base_model") and callable(module.get_base_model):
            inner = module.get_base_model()
        elif isinstance(getattr(module, "module", None), torch.nn.Module):
            inner = module.module
        else:
            return module
        if inner is module:
            return module
        module = inner


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder/encoder layers to shard one by one.

    The ``transformers`` model's ``_no_split_modules`` names them; without it, the children of the
    first ``nn.ModuleList`` (``model.layers``, ``transformer.h`` ...) are taken.
    """
    names = set(getattr(base_model(module), "_no_split_modules", None) or ())
    if names:
        blocks = [m for m in module.modules() if type(m).__name__ in names]
        # keep the outermost ones: a block class may (rarely) nest inside another
        inner = {id(c) for b in blocks for c in b.modules() if c is not b}
        blocks = [b for b in blocks if id(b) not in inner]
        if blocks:
            return blocks
    for child in module.modules():
        if isinstance(child, torch.nn.ModuleList) and len(child) > 0:
            return list(child)
    return []


def peft_adapter_names(module: torch.nn.Module) -> list[str]:
    """Names of the PEFT adapters of ``module`` (a ``PeftModel``; empty for a plain model)."""
    config = getattr(module, "peft_config", None)
    return sorted(config) if isinstance(config, dict) else []


@contextlib.contextmanager
def requiring_grad(params: Iterable[torch.nn.Parameter]) -> Iterator[None]:
    """Mark ``params`` trainable for the duration of the block, then restore their flags.

    PEFT freezes every adapter but the active one, while wrappers and engines that collect their
    parameters once (DDP's reducer, DeepSpeed's engine and its per-parameter fp32 APIs) skip frozen ones.
    """
    frozen = [p for p in params if not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def all_adapters_trainable(module: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
    """Every PEFT adapter's weights trainable for the block, when ``module`` holds several.

    A wrapper that registers parameters when it is built (DDP) must see every tenant's weights, or the
    adapters trained later would never be synced. One adapter (or none) is left as it is: a frozen
    reference model stays frozen.
    """
    from twinkle_backend_hf import adapters

    names = peft_adapter_names(module)
    if len(names) <= 1:
        return contextlib.nullcontext()
    wanted = {n for name in names for n in adapters.parameter_names(module, name)}
    return requiring_grad(p for n, p in module.named_parameters() if n in wanted)
