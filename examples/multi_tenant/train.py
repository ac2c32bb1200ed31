"""Multi-tenant LoRA from Python: several tenants' adapters trained on one shared, frozen base model.

``MultiLoraTransformersModel`` keeps one LoRA adapter per tenant, each with its own optimizer, learning-rate
schedule, loss and step counter; every call names its tenant with ``adapter_name=``. Here three tenants
learn one of the quickstart's string operations each (``reverse``, ``upper``, ``double``: the quickstart's
chats split into single-turn chats by operation), taking turns step by step, and each tenant's adapter is
saved as a plain PEFT directory (``PeftModel.from_pretrained`` loads it onto the base).

    python examples/multi_tenant/train.py                          # the bundled tiny base, no download
    python examples/multi_tenant/train.py --model-id hf://Qwen/Qwen2.5-0.5B-Instruct --output-dir outputs/mt
    python examples/multi_tenant/train.py --steps 2 --output-dir /tmp/mt   # a smoke run

Without ``--model-id`` the base is the quickstart's architecture, randomly initialised (seeded) and saved to
``OUTPUT_DIR/base`` first; the adapters name it as their base, so ``twinkle chat OUTPUT_DIR/reverse`` works.
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
QUICKSTART = os.path.join(HERE, "..", "quickstart")
TENANTS = ("reverse", "upper", "double")
#: the quickstart's model, built from this config when no --model-id is given
TINY_CONFIG = {"model_type": "qwen2", "vocab_size": 262, "hidden_size": 128, "intermediate_size": 384,
               "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256, "tie_word_embeddings": True,
               "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def single_turn_chats(path: str, operation: str) -> list[dict]:
    """The user/assistant pairs of ``path``'s chats whose prompt is ``operation: word``, one chat each."""
    chats = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            messages = json.loads(line)["messages"]
            for user, assistant in zip(messages[::2], messages[1::2]):
                if user["content"].startswith(operation + ":"):
                    chats.append({"messages": [user, assistant]})
    return chats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-id", help="base model: a local directory, hf://org/name or ms://org/name "
                                           "(default: the quickstart's architecture, randomly initialised)")
    parser.add_argument("--tokenizer", help="tokenizer (default: the model's, or the quickstart's)")
    parser.add_argument("--output-dir", default=os.path.join(HERE, "..", "..", "outputs", "multi_tenant"))
    parser.add_argument("--tenants", default=",".join(TENANTS), help="comma-separated, from " + ", ".join(TENANTS))
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per tenant")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (every tenant here; they may differ)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import AutoTokenizer

    from twinkle.model import MultiLoraTransformersModel
    from twinkle_core.data import DataLoader, Template, collate_causal_lm
    from twinkle_core.sources.resolve import resolve_model

    tenants = [t.strip() for t in args.tenants.split(",") if t.strip()]
    unknown = sorted(set(tenants) - set(TENANTS))
    if unknown or not tenants:
        parser.error(f"--tenants: unknown {unknown}; choose from {', '.join(TENANTS)}")
    output_dir = os.path.abspath(args.output_dir)

    tokenizer_dir = resolve_model(args.tokenizer or args.model_id or os.path.join(QUICKSTART, "tokenizer"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model_id = args.model_id or write_tiny_base(os.path.join(output_dir, "base"), tokenizer, args.seed)
    # one base model, shared by every tenant and frozen; the tokenizer is saved with every adapter
    model = MultiLoraTransformersModel(model_id=model_id, tokenizer=tokenizer, seed=args.seed, max_lora_rank=64)

    template = Template(tokenizer, max_length=64, mode="chat")
    collate = lambda features: collate_causal_lm(features, pad_token_id=template.pad_token_id)  # noqa: E731
    # adapter names: any name that is not an nn.Module attribute ("double" is one, so: "tenant_double")
    names = [f"tenant_{op}" for op in tenants]
    loaders, held_out = {}, {}
    for i, (op, name) in enumerate(zip(tenants, names)):
        # each tenant: its own adapter, optimizer, schedule and loss (any of them may differ per tenant)
        model.add_adapter_to_model(name, {"r": args.rank, "lora_alpha": 2 * args.rank,
                                          "target_modules": "all-linear"})
        model.set_optimizer("AdamW", lr=args.lr, adapter_name=name)
        model.set_lr_scheduler("cosine", num_training_steps=args.steps, num_warmup_steps=min(20, args.steps // 10),
                               adapter_name=name)
        model.set_loss("cross_entropy", adapter_name=name)
        features = [template.encode(row) for row in single_turn_chats(os.path.join(QUICKSTART, "train.jsonl"), op)]
        loaders[name] = cycle_epochs(DataLoader(features, args.batch_size, collate, seed=args.seed + i))
        eval_rows = single_turn_chats(os.path.join(QUICKSTART, "eval.jsonl"), op)
        held_out[op] = collate([template.encode(row) for row in eval_rows])
        print(f"tenant {name!r}: {len(features)} training chats, {len(eval_rows)} held-out")

    # the tenants take turns, one optimizer step each; a step of one tenant never touches another's weights
    log_every = max(1, args.steps // 10)
    for step in range(1, args.steps + 1):
        losses = {}
        for name in names:
            out = model.forward_backward(inputs=next(loaders[name]), adapter_name=name)
            model.clip_grad_and_step(max_grad_norm=1.0, adapter_name=name)
            losses[name] = float(out["loss"])
        if step % log_every == 0 or step == args.steps:
            print(f"step {step}/{args.steps} " + " ".join(f"{n} {v:.4f}" for n, v in losses.items()), flush=True)

    # held-out loss of every tenant on every operation: each adapter is best at its own
    results = {}
    for name in names:
        row = {}
        for data_name, batch in held_out.items():
            result = model.calculate_loss(inputs=batch, outputs=model.forward_only(inputs=batch, adapter_name=name),
                                          adapter_name=name)
            row[data_name] = float(result.loss) / float(result.num_tokens)
        results[name] = row
        print(f"adapter {name!r} held-out loss: " + " ".join(f"{k} {v:.4f}" for k, v in row.items()))

    for name in names:  # a plain PEFT adapter directory per tenant (plus the tokenizer)
        path = model.save(name, output_dir=output_dir, adapter_name=name, save_optimizer=False)
        print(f"adapter {name!r}: {path}")
    with open(os.path.join(output_dir, "results.json"), "w") as handle:
        json.dump({"steps": args.steps, "held_out_loss": results}, handle, indent=2)


def write_tiny_base(directory: str, tokenizer, seed: int) -> str:
    """The quickstart's architecture, randomly initialised (seeded), saved as a transformers directory: the
    adapters record it as their base (``base_model_name_or_path``), so ``twinkle chat`` and PEFT find it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_CONFIG)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    print(f"base model (random init): {directory}")
    return directory


def cycle_epochs(loader):
    """Endless batches: every pass over the loader is the next epoch, shuffled anew."""
    while True:
        yield from loader


if __name__ == "__main__":
    main()
