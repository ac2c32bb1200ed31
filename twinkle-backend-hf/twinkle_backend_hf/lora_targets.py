"""Which PEFT ``target_modules`` names select a transformers model's attention, MLP and LM-head linear layers.

A linear layer is of kind ``attn`` when one of its parent modules is named like an attention block, ``mlp`` when one
is named like a feed-forward block, ``unembed`` when it is the model's output embedding (the LM head). A layer
PEFT already wrapped (an adapter exists) counts as the linear layer it wraps; its own ``lora_A`` / ``lora_B`` are
not targets.
"""

from __future__ import annotations

import torch

from twinkle_core.lora import TARGET_KINDS

#: parent module names of attention and feed-forward blocks across the transformers families
ATTENTION = frozenset({"self_attn", "attn", "attention", "self_attention", "cross_attn"})
MLP = frozenset({"mlp", "feed_forward", "ffn", "experts", "shared_expert", "shared_experts", "block_sparse_moe"})


def by_kind(network: torch.nn.Module) -> dict[str, list[str]]:
    """The names per kind (``TARGET_KINDS``): a layer's leaf name where no linear layer of another kind (or of no
    kind) has that leaf name, its full module path otherwise (PEFT matches both by suffix), so a kind's names select
    its own layers only."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    head = network.get_output_embeddings() if hasattr(network, "get_output_embeddings") else None
    found: dict[str, dict[str, list[str]]] = {kind: {} for kind in (*TARGET_KINDS, "other")}
    inside = None  # the PEFT layer being walked (named_modules is depth first): its base_layer, lora_A ... are not
    for path, module in network.named_modules():
        if inside is not None and path.startswith(inside):
            continue
        linear = module
        if isinstance(module, BaseTunerLayer):
            inside, linear = path + ".", module.get_base_layer()
        if not isinstance(linear, torch.nn.Linear):
            continue
        parents = set(path.split(".")[:-1])
        kind = ("unembed" if head is not None and (module is head or linear is head) else
                "attn" if parents & ATTENTION else "mlp" if parents & MLP else "other")
        found[kind].setdefault(path.rsplit(".", 1)[-1], []).append(path)
    owners: dict[str, int] = {}
    for leaves in found.values():
        for leaf in leaves:
            owners[leaf] = owners.get(leaf, 0) + 1
    return {kind: sorted(t for leaf, paths in leaves.items() for t in ([leaf] if owners[leaf] == 1 else paths))
            for kind, leaves in found.items() if kind != "other"}
