"""``twinkle eval CHECKPOINT [DATA]``: loss, perplexity and exact match of a checkpoint on a data set.

``DATA`` is JSONL (or any format ``twinkle train`` reads) of chats (OpenAI ``messages``, ShareGPT
``conversations`` or Alpaca rows) or of ``{"text": ...}`` rows:

- **loss / perplexity**: mean negative log-likelihood per token of the assistant turns (chats: the tokens the
  chat template adds for each assistant turn) or of the whole text (text rows); perplexity = exp(loss);
- **exact match** (chats): the greedy answer to the conversation up to its last assistant turn equals that turn
  (both stripped).

The numbers are printed as a table and, with ``--output FILE``, written as JSON. ``--tasks a,b`` also runs
lm-eval's tasks (``pip install lm-eval``) on the loaded model through ``lm_eval.simple_evaluate``;
``--include-path DIR`` adds task YAMLs of your own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from twinkle_backend_hf.commands.checkpoint_loading import add_checkpoint_arguments
from twinkle_core.commands import Command
from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError

LM_EVAL_MISSING = ("--tasks runs lm-eval's tasks, and the lm-eval package is not installed: pip install lm-eval")


class EvalCommand(Command):
    description = ("Evaluate a checkpoint on a chat or text JSONL: loss, perplexity and (chats) "
                   "exact match of the greedy answer to the last assistant turn; optionally "
                   "lm-eval tasks (--tasks).")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("checkpoint", help="checkpoint directory")
        parser.add_argument("data", nargs="?", help="chat or text rows (JSONL, or any format twinkle train reads)")
        parser.add_argument("--output", "-o", metavar="FILE",
                            help="also write the results as JSON (never over an input; an existing file only with "
                                 "--overwrite)")
        parser.add_argument("--overwrite", action="store_true", help="replace an existing --output FILE")
        parser.add_argument("--limit", type=int, help="evaluate the first N rows only (lm-eval: N per task)")
        parser.add_argument("--batch-size", type=int, default=8, help="rows per forward / generate call (default 8)")
        parser.add_argument("--max-length", type=int, help="truncate sequences to this many tokens "
                                                           "(default: the model's max_position_embeddings)")
        parser.add_argument("--max-new-tokens", type=int, default=64,
                            help="answer length limit for exact match (default 64)")
        parser.add_argument("--no-generate", action="store_true", help="loss and perplexity only (no exact match)")
        parser.add_argument("--tasks", metavar="NAME[,NAME]", help="lm-eval tasks to run (needs: pip install lm-eval)")
        parser.add_argument("--include-path", metavar="DIR", help="a directory of lm-eval task YAMLs (with --tasks)")
        parser.add_argument("--device", help="a torch device such as cpu, cuda:1 or npu:0 (default: the active "
                                             "accelerator's device, see twinkle plugins)")
        add_checkpoint_arguments(parser)

    def run(self, args: argparse.Namespace) -> int:
        return evaluate(args)


# ---------------------------------------------------------------------- data
def read_examples(path: str, limit: int | None = None) -> list[dict[str, Any]]:
    """``[{"messages": [...]}]`` for chat rows, ``[{"text": ...}]`` for text rows."""
    from twinkle_core.data.formats import RowError, is_conversation_row, normalize_conversation
    from twinkle_core.data.loading import load_rows

    if not Path(path).expanduser().exists():
        raise ConfigError(f"data {path!r} does not exist; pass a JSONL file of chat ('messages') or text rows")
    if Path(path).expanduser().is_dir():
        raise ConfigError(f"data {path!r} is a directory; pass a JSONL file of chat ('messages') or text rows")
    rows = load_rows(str(Path(path).expanduser()), validate=None)
    if limit is not None:
        rows = rows[:limit]
    examples = []
    for number, row in enumerate(rows, 1):
        if is_conversation_row(row):
            try:
                messages, _ = normalize_conversation(row)
            except RowError as exc:
                raise ConfigError(f"{path}:{number}: {exc}") from None
            messages = [{"role": m["role"], "content": m.get("content") or ""} for m in messages]
            if not any(m["role"] == "assistant" for m in messages):
                raise ConfigError(f"{path}:{number}: the conversation has no assistant turn to evaluate")
            examples.append({"messages": messages})
        elif isinstance(row, dict) and isinstance(row.get("text"), str):
            examples.append({"text": row["text"]})
        else:
            raise ConfigError(f"{path}:{number}: expected a chat row ('messages', 'conversations' or Alpaca "
                              f"'instruction'/'output') or a text row ('text')")
    if not examples:
        raise ConfigError(f"data {path!r} holds no rows")
    return examples


def loss_sequences(tokenizer: Any, examples: list[dict[str, Any]],
                   max_length: int) -> list[tuple[list[int], list[int]]]:
    """``[(input_ids, labels)]`` (-100 where no loss is taken) labelled as ``twinkle train`` labels them
    (:class:`twinkle_core.data.template.Template`): every assistant turn with its end-of-turn token, or every
    token of a text row (with EOS)."""
    from twinkle_core.data.formats import RowError
    from twinkle_core.data.template import Template

    templates: dict[str, Any] = {}
    sequences = []
    for number, example in enumerate(examples, 1):
        mode = "pretrain" if "text" in example else "chat"
        if mode not in templates:
            templates[mode] = Template(tokenizer, max_length=max_length, mode=mode)
        try:
            feature = templates[mode].encode(example)
        except RowError as exc:
            raise ConfigError(f"row {number}: {exc}") from None
        sequences.append((list(feature.input_ids), list(feature.labels)))
    return sequences


def compute_loss(model: Any, tokenizer: Any, examples: list[dict[str, Any]], *, batch_size: int,
                 max_length: int) -> tuple[float, int]:
    """(summed NLL, label tokens) over the examples."""
    import torch

    sequences = loss_sequences(tokenizer, examples, max_length)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start:start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (seq, lab) in enumerate(batch):
            ids[row, :len(seq)] = torch.tensor(seq)
            labels[row, :len(lab)] = torch.tensor(lab)
            mask[row, :len(seq)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits
        shift_logits = logits[:, :-1].float()
        shift_labels = labels[:, 1:].to(device)
        nll = torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                                shift_labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        total += float(nll)
        count += int((shift_labels != IGNORE_INDEX).sum())
    return total, count


def exact_match(model: Any, tokenizer: Any, examples: list[dict[str, Any]], *, batch_size: int,
                max_new_tokens: int) -> tuple[float, int, list[dict[str, Any]]]:
    """(exact-match rate, examples judged, predictions) for the chat examples."""
    import torch

    from twinkle_backend_hf.commands.checkpoint_loading import generation_kwargs, pad_token_id, stop_token_ids

    stops = stop_token_ids(tokenizer, model)
    pad = pad_token_id(tokenizer, stops)
    kwargs = generation_kwargs(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens, stops=stops, pad_id=pad)
    from twinkle_core.data.template import Template

    template = Template(tokenizer, mode="chat")  # prompts tokenised as twinkle train's evaluation does
    prompts = []
    for e in examples:
        if "messages" not in e:
            continue
        last = max(i for i, m in enumerate(e["messages"]) if m["role"] == "assistant")
        prompts.append((list(template.encode_prompt(e["messages"][:last])),
                        e["messages"][last]["content"]))
    device = next(model.parameters()).device
    predictions = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start:start + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, (seq, _) in enumerate(batch):  # left padding: every answer starts at column `width`
            ids[row, width - len(seq):] = torch.tensor(seq)
            mask[row, width - len(seq):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        for row, (_, reference) in enumerate(batch):
            answer = tokenizer.decode(out[row, width:], skip_special_tokens=True).strip()
            predictions.append({"prediction": answer, "reference": reference,
                                "correct": answer == reference.strip()})
    if not predictions:
        return float("nan"), 0, []
    return sum(p["correct"] for p in predictions) / len(predictions), len(predictions), predictions


# ---------------------------------------------------------------------- lm-eval
def check_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(LM_EVAL_MISSING) from None


def lm_eval_data_missing(tasks: list[str], exc: BaseException) -> str:
    """What to do when lm-eval cannot get a task's data set: lm-eval reads it with ``datasets`` from the hub, or
    offline from the ``datasets`` cache only."""
    offline = any(os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
                  for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    where = ("offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set) lm-eval reads data sets only from the Hugging "
             "Face datasets cache, and it does not hold this one" if offline else "the hub could not be reached")
    return (f"--tasks {','.join(tasks)}: lm-eval could not load the task's data set ({exc}); {where}. Run it once "
            f"online to fill the cache (HF_HOME / HF_DATASETS_CACHE say where; copy a filled cache to an offline "
            f"machine), or evaluate local files: a task YAML of your own with dataset_path: json and "
            f"dataset_kwargs: {{data_files: ...}} in a directory passed with --include-path DIR, or a chat / text "
            f"JSONL as DATA")


def run_lm_eval(model: Any, tokenizer: Any, tasks: list[str], *, batch_size: int, limit: int | None,
                include_path: str | None) -> dict[str, dict[str, Any]]:
    """``{task: {metric: value}}`` from ``lm_eval.simple_evaluate`` on the loaded model."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).expanduser().is_dir():
        raise ConfigError(f"--include-path {include_path!r} is not a directory of lm-eval task YAMLs")
    manager = TaskManager(include_path=str(Path(include_path).expanduser()) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"lm-eval has no task {', '.join(map(repr, unknown))}; 'lm-eval ls tasks' lists them"
                          + ("" if include_path else ", and --include-path DIR adds your own task YAMLs"))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    try:
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager)
    except ConnectionError as exc:  # datasets cannot fetch a task's data set (offline, or the hub unreachable)
        raise ConfigError(lm_eval_data_missing(tasks, exc)) from None
    results: dict[str, dict[str, Any]] = {}
    for task, metrics in (out or {}).get("results", {}).items():
        results[task] = {k: v for k, v in metrics.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "alias"}
    return results


# ---------------------------------------------------------------------- output
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def format_table(results: dict[str, Any]) -> str:
    rows = [("metric", "value")]
    rows += [(k, _fmt(v)) for k, v in results.get("metrics", {}).items()]
    for task, metrics in results.get("lm_eval", {}).items():
        rows += [(f"{task}/{k}", _fmt(v)) for k, v in metrics.items()]
    width = max(len(r[0]) for r in rows)
    lines = [f"{r[0].ljust(width)}  {r[1]}" for r in rows]
    lines.insert(1, "-" * width + "  " + "-" * max(len(r[1]) for r in rows))
    return "\n".join(lines)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def evaluate(args: argparse.Namespace) -> int:
    from twinkle_backend_hf.commands.checkpoint_loading import (
        checked_device,
        load_model,
        load_tokenizer,
        resolve_checkpoint,
        tokenizer_source,
        verify_checkpoint_files,
    )
    from twinkle_core.threads import configure_threads

    tasks = checked_tasks(args)
    checked_device(args.device)
    ckpt = resolve_checkpoint(args.checkpoint, args.base, trust_remote_code=args.trust_remote_code)
    output = checked_output(args, ckpt)
    verify_checkpoint_files(ckpt)  # a damaged file is refused before any of them is loaded
    examples = read_examples(args.data, args.limit) if args.data else []
    tokenizer = load_tokenizer(ckpt)
    if any("messages" in e for e in examples) and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{args.data} holds chats and the tokenizer in {tokenizer_source(ckpt)} has no chat "
                          f"template: save one with it ('chat_template' in tokenizer_config.json, or "
                          f"chat_template.jinja), or evaluate text rows ({{\"text\": ...}})")
    # this process's share of the free cores, unless OMP_NUM_THREADS says otherwise
    configure_threads(say=lambda line: print(f"twinkle: {line}", file=sys.stderr))
    model = load_model(ckpt, dtype=args.dtype, device=args.device)
    results: dict[str, Any] = {"checkpoint": str(ckpt.path), "data": args.data, "metrics": {}}
    if examples:
        results.update(data_metrics(model, tokenizer, examples, args))
    if tasks:
        results["lm_eval"] = run_lm_eval(model, tokenizer, tasks, batch_size=args.batch_size, limit=args.limit,
                                         include_path=args.include_path)
    print(format_table(results))
    if output is not None:
        write_results(results, output)
    return 0


def checked_output(args: argparse.Namespace, ckpt: Any) -> Path | None:
    """The ``--output`` file, checked before anything loads: never a directory, a file of the checkpoint (or of
    an adapter's base) or the data file, and an existing file only with ``--overwrite``."""
    from twinkle_backend_hf.commands.checkpoint_loading import (
        check_parent_writable,
        input_directories,
        is_within,
    )

    if not args.output:
        return None
    output = Path(args.output).expanduser()
    resolved = output.resolve()
    if output.is_dir():
        raise ConfigError(f"--output {args.output} is a directory; eval writes one JSON file: pass a file path "
                          f"such as {output / 'eval_results.json'}")
    for directory in input_directories(ckpt):
        if is_within(resolved, directory):
            raise ConfigError(f"--output {args.output} lies inside the checkpoint {directory} that eval reads; "
                              f"write the results outside it (e.g. --output eval_results.json)")
    if args.data and resolved == Path(args.data).expanduser().resolve():
        raise ConfigError(f"--output {args.output} is the data file eval reads; choose another file")
    if output.exists() and not args.overwrite:
        raise ConfigError(f"--output {args.output} already exists; choose a new file or add --overwrite to "
                          f"replace it")
    check_parent_writable(output)
    return output


def checked_tasks(args: argparse.Namespace) -> list[str]:
    """The lm-eval tasks asked for; the arguments checked before anything loads."""
    tasks = [t.strip() for t in (args.tasks or "").split(",") if t.strip()]
    if not args.data and not tasks:
        raise ConfigError("twinkle eval needs DATA (a chat or text JSONL) and/or --tasks NAME[,NAME] (lm-eval)")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    if tasks:
        check_lm_eval()
    return tasks


def data_metrics(model: Any, tokenizer: Any, examples: list[dict[str, Any]],
                 args: argparse.Namespace) -> dict[str, Any]:
    """``{"metrics": loss, perplexity (and exact match of chats)}``, with ``"predictions"`` when answers were
    generated."""
    max_length = args.max_length or int(getattr(model.config, "max_position_embeddings", 0) or 4096)
    nll, tokens = compute_loss(model, tokenizer, examples, batch_size=args.batch_size, max_length=max_length)
    loss = nll / tokens if tokens else float("nan")
    metrics = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)) if tokens else float("nan"),
               "num_examples": len(examples), "num_loss_tokens": tokens}
    results: dict[str, Any] = {"metrics": metrics}
    if not args.no_generate and any("messages" in e for e in examples):
        rate, judged, predictions = exact_match(model, tokenizer, examples, batch_size=args.batch_size,
                                                max_new_tokens=args.max_new_tokens)
        metrics.update(exact_match=rate, num_exact_match_examples=judged)
        results["predictions"] = predictions
    return results


def write_results(results: dict[str, Any], path: Path) -> None:
    """Write the JSON beside ``path`` and rename it into place: a failed write leaves ``path`` as it was."""
    from twinkle_backend_hf.commands.checkpoint_loading import output_write_error

    staging = path.parent / f".{path.name}.incomplete"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(json.dumps(_json_safe(results), indent=2) + "\n")
        os.replace(staging, path)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise output_write_error(path, exc) from None
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    print(f"twinkle: results written to {path}", file=sys.stderr)
