"""VLM loss-parity run: the tiny VLM with the ``vlm`` task (default plan: vision frozen, projector full, LoRA on the
language model) or the ``vlm_preference`` task (DPO) under any strategy; per-step global losses to JSON.

    python vlm_parity.py OUT.json MODEL_DIR ROWS.json                       # one process, the reference
    torchrun --nproc-per-node 2 vlm_parity.py OUT.json MODEL_DIR ROWS.json --strategy ddp
    torchrun --nproc-per-node 2 vlm_parity.py OUT.json MODEL_DIR ROWS.json --strategy native_fsdp \
        --task vlm_preference --reference auto model

Every step trains on all rows of ROWS.json (the colour chats of the tests' ``colour_rows``).

* ``vlm``: data-parallel rank r encodes its own share (rows r, r + world, ...), because a VLM batch's vision tensors
  cannot be split by row after collation.
* ``vlm_preference``: each chat becomes a pair (:func:`colour_pairs`); every rank encodes all pairs and the
  trainer's ``DataLoader`` deals it its share of whole pairs (a feature is a pair, so a pair's two sequences, their
  image copies and reference log-probs stay on one rank), completed per step by ``task.prepare_batch`` (3-D RoPE
  positions, then the reference log-probs) as ``twinkle train`` does. ``--reference``: ``auto`` (the adapter's base
  under the default plan's LoRA), or ``model`` (every part trained fully, a frozen copy as the reference).

SGD without clipping, so each step's update is exactly the gradient of the global loss (token mean, or mean over
pairs). Rank 0 writes ``{"losses": [...], ...}``; with ``vlm_preference``, per reference,
``{"auto": {"losses": [...], "metrics": {"rewards/margins": [...], ...}, ...}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

LORA = {"type": "lora", "r": 4, "lora_alpha": 8}
#: every part trained (the ``model`` reference copies the whole initial model)
FULL_PLAN = {"train_vision": "full", "train_projector": "full", "train_language": "full"}
#: the DPO beta of the preference runs: 1, as the VLM preference quickstart takes for a random model, so that a few
#: steps move the implicit rewards beta * (pi - ref) out of the linear range of -log sigmoid, where the loss of a
#: batch would hardly depend on which chosen answer is paired with which rejected one
BETA = 1.0
#: the SGD learning rate of the preference runs, per reference: full fine-tuning (a frozen copy) moves every
#: weight and overshoots at the LoRA runs' rate (the loss rose from step 2, measured)
PREFERENCE_LR = {"auto": 0.5, "model": 0.02}
#: the DPO metrics every preference step records (twinkle_rl.losses.dpo)
PAIR_METRICS = ("rewards/margins", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen",
                "logps/rejected")


def colour_pairs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The colour chats as preference pairs: the picture's colour chosen, the next chat's colour rejected."""
    names = [row["messages"][1]["content"] for row in rows]
    return [{"messages": row["messages"][:1], "chosen": name, "rejected": names[(i + 1) % len(names)]}
            for i, (row, name) in enumerate(zip(rows, names, strict=True))]


def preference_model(model_dir: str, reference: str, strategy: str | None, strategy_options: Any) -> tuple[Any, Any]:
    """``(model, task)`` prepared as the trainer prepares them: ``task.prepare_model`` (the frozen copy), then the
    adapter under the default plan, the DPO loss and SGD."""
    from twinkle_backend_hf.model import TransformersModel
    from twinkle_vlm.preference import VLMPreferenceTask

    full = reference == "model"
    task = VLMPreferenceTask(reference=reference, **(FULL_PLAN if full else {}))
    tokenizer = TransformersModel.load_tokenizer(model_dir)
    model = TransformersModel(model_id=model_dir, task=task, tokenizer=tokenizer, strategy_options=strategy_options,
                              **({"strategy": strategy} if strategy else {}))
    task.prepare_model(model)
    name = None if full else "default"
    if name:
        model.add_adapter_to_model(name, dict(LORA))
    model.set_loss("dpo", adapter_name=name, beta=BETA)
    model.set_optimizer("SGD", adapter_name=name, lr=PREFERENCE_LR[reference])
    return model, task


def train_preference(args: argparse.Namespace, rows: list[dict[str, Any]], reference: str) -> dict[str, Any]:
    from twinkle_core.data.loader import DataLoader

    model, task = preference_model(args.model_dir, reference, args.strategy, args.strategy_options)
    name = None if reference == "model" else "default"
    cfg = model.get_train_configs(adapter_name=name)
    rank, size = cfg["dp_rank"] or 0, cfg["dp_size"] or 1
    features = task.load_dataset(colour_pairs(rows), model.tokenizer)
    features = task.prepare_dataset(model, features, split="train", output_dir=f"{args.out}.work/{reference}")
    if len(features) % size:
        raise SystemExit(f"{len(features)} pairs do not split over {size} data-parallel ranks")
    local = next(iter(DataLoader(features, len(features) // size, task.collate, shuffle=False, dp_rank=rank,
                                 dp_size=size)))
    losses, metrics = [], {key: [] for key in PAIR_METRICS}
    for _ in range(args.steps):
        batch = task.prepare_batch(model, local)  # positions and reference log-probs, as the trainer does per batch
        model.forward_backward(inputs=batch, adapter_name=name)
        model.clip_grad_and_step(None, adapter_name=name)
        step = model.calculate_metric(adapter_name=name)
        losses.append(float(step["loss"]))
        for key in PAIR_METRICS:
            metrics[key].append(float(step[key]))
    copy = getattr(task.provider, "copy", None)  # the frozen reference model (reference: model)
    return {"model": model, "losses": losses, "metrics": metrics, "dp_size": size,
            "reference_wrapped_class": None if copy is None else type(copy.wrapped).__name__}


def train_chats(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    from twinkle_vlm.testing import build_vlm_model, vlm_batch

    model, task = build_vlm_model(args.model_dir, adapter=dict(LORA), strategy=args.strategy,
                                  strategy_options=args.strategy_options)
    cfg = model.get_train_configs()
    rank, size = cfg["dp_rank"] or 0, cfg["dp_size"] or 1
    batch = vlm_batch(task, model, rows[rank::size])
    losses = []
    for _ in range(args.steps):
        model.forward_backward(inputs=batch, adapter_name="default")
        model.clip_grad_and_step(None, adapter_name="default")
        losses.append(float(model.calculate_metric(adapter_name="default")["loss"]))
    # what the model saw besides token ids (pictures: pixel_values ...; clips: pixel_values_videos ...)
    vision = sorted(key for key in task.model_inputs if key in batch)
    return {"model": model, "losses": losses, "dp_size": size, "vision_inputs": vision}


def described(result: dict[str, Any]) -> dict[str, Any]:
    """A run's result without its model, plus how the model was distributed."""
    from torch.distributed.fsdp import FSDPModule

    from twinkle_core import distributed

    model = result.pop("model")
    return {**result, "world_size": distributed.world_size(), "wrapped_class": type(model.wrapped).__name__,
            # the module classes FSDP2 made units of (empty under other strategies)
            "fsdp_units": sorted({type(m).__name__ for m in model.wrapped.modules() if isinstance(m, FSDPModule)})}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("model_dir")
    parser.add_argument("rows")
    parser.add_argument("--strategy", default=None)
    parser.add_argument("--strategy-options", type=json.loads, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--task", choices=("vlm", "vlm_preference"), default="vlm")
    parser.add_argument("--reference", choices=("auto", "model"), nargs="+", default=["auto"],
                        help="vlm_preference: auto (LoRA, its base) and/or model (full fine-tuning, a frozen copy); "
                             "several run one after the other and give {reference: result}")
    args = parser.parse_args()

    from twinkle_core import distributed

    with open(args.rows) as fh:
        rows = json.load(fh)
    if args.task == "vlm_preference":
        result = {reference: described(train_preference(args, rows, reference)) for reference in args.reference}
    else:
        result = described(train_chats(args, rows))
    if distributed.is_main_process():
        with open(args.out + ".tmp", "w") as fh:
            json.dump(result, fh)
        os.replace(args.out + ".tmp", args.out)
    distributed.barrier()


if __name__ == "__main__":
    main()
    from twinkle_core.testing.torchrun import exit_job

    exit_job()
