"""The ``gkd`` task (on-policy distillation, issue 24): its batches carry the teacher's logits of exactly their ids
and label only the last answer; ``lmbda`` chooses data answers or the student's samples (seeded, as TRL's
``GKDTrainer``); ``seq_kd`` samples from the teacher; recipe checks; and end to end, a tiny student distilled by
``twinkle train`` from a teacher SFT-trained here comes closer to it and learns its answers.

Teachers are tiny Qwen2 models with the bundled quickstart tokenizer (vocabulary 262): a random one saved with
``save_pretrained`` for the batch tests, and one trained for 300 steps on an "upper: abc" task for the end-to-end
run.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from twinkle_core import cli
from twinkle_core.constants import IGNORE_INDEX
from twinkle_core.errors import ConfigError
from twinkle_core.testing.tolerance import forward_tolerance

pytest.importorskip("twinkle_backend_hf")

from twinkle_rl.distill_batches import batch_prompts  # noqa: E402
from twinkle_rl.distill_task import GKDTask  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TOKENIZER_DIR = REPO / "examples" / "quickstart" / "tokenizer"
EXAMPLE = REPO / "examples" / "distill" / "recipe.yaml"
CHATS = [json.loads(line) for line in (REPO / "examples" / "quickstart" / "train.jsonl").read_text().splitlines()[:6]]
TEACHER_WIDTH, TEACHER_DEPTH = 64, 2


def qwen2_config(vocab_size: int, hidden_size: int, layers: int = 2) -> dict:
    return {"model_type": "qwen2", "vocab_size": vocab_size, "hidden_size": hidden_size,
            "intermediate_size": 2 * hidden_size, "num_hidden_layers": layers, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": True,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def save_random_teacher(directory: Path, tokenizer, vocab_size: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = qwen2_config(vocab_size, TEACHER_WIDTH, TEACHER_DEPTH)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tokenizer):
    return save_random_teacher(tmp_path_factory.mktemp("teacher"), tokenizer, len(tokenizer))


def student(tokenizer, task):
    from twinkle_backend_hf.model import TransformersModel

    return TransformersModel(config=qwen2_config(len(tokenizer), 32), seed=0, tokenizer=tokenizer, task=task)


def data_batch(task, tokenizer, rows=CHATS[:4]):
    return task.collate(task.load_dataset(list(rows), tokenizer))


# --------------------------------------------------------------------------- batches
def test_the_batch_carries_the_teachers_logits_of_its_ids_and_labels_only_the_last_answer(tokenizer, teacher_dir):
    from transformers import AutoModelForCausalLM

    from twinkle_core.data.template import Template

    task = GKDTask(teacher=teacher_dir, lmbda=0.0)
    model = student(tokenizer, task)
    batch = task.next_training_batch(model, lambda: data_batch(task, tokenizer))

    reference = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():
        want = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    got = batch["teacher_logits"]
    assert got.shape == (*batch["input_ids"].shape, len(tokenizer)) and got.dtype == torch.float32
    real = batch["attention_mask"].bool()  # padded positions are not compared (the loss never reads them)
    tolerance = forward_tolerance(float(want.abs().max()), width=TEACHER_WIDTH, depth=TEACHER_DEPTH)
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=tolerance)

    template = Template(tokenizer, mode="chat")
    for s, row in enumerate(CHATS[:4]):
        prompt = template.encode_prompt(row["messages"][:-1])
        assert batch["input_ids"][s, :len(prompt)].tolist() == prompt
        labels = batch["labels"][s]
        assert (labels[:len(prompt)] == IGNORE_INDEX).all()  # the prompt, earlier answers included, is masked
        answer = labels[labels != IGNORE_INDEX].tolist()
        assert tokenizer.decode(answer) == row["messages"][-1]["content"] + "<|im_end|>"


def test_lmbda_0_trains_on_the_data_answers_and_lmbda_1_on_seeded_student_samples(tokenizer, teacher_dir):
    def batch_of(lmbda, seq_kd=False, seed=0):
        task = GKDTask(teacher=teacher_dir, lmbda=lmbda, seq_kd=seq_kd, max_new_tokens=6, temperature=1.0, seed=seed)
        model = student(tokenizer, task)
        data = data_batch(task, tokenizer)
        return data, task.next_training_batch(model, lambda: data), task.step_metrics()

    data, off_policy, metrics = batch_of(0.0)
    for key in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(off_policy[key], data[key]), key
    assert metrics["on_policy_fraction"] == 0.0 and metrics["teacher_sampled_fraction"] == 0.0

    _, on_policy, metrics = batch_of(1.0)
    _, again, _ = batch_of(1.0)
    _, other_seed, _ = batch_of(1.0, seed=1)
    _, from_teacher, teacher_metrics = batch_of(0.0, seq_kd=True)
    assert metrics["on_policy_fraction"] == 1.0 and teacher_metrics["teacher_sampled_fraction"] == 1.0
    assert batch_prompts(on_policy) == batch_prompts(data)  # the same prompts, new completions
    assert torch.equal(on_policy["input_ids"], again["input_ids"])  # seeded
    assert not torch.equal(on_policy["input_ids"], other_seed["input_ids"])
    assert not torch.equal(on_policy["input_ids"], from_teacher["input_ids"])  # the student's, not the teacher's
    completions = (on_policy["labels"] != IGNORE_INDEX).sum(-1)
    assert ((completions >= 1) & (completions <= 6)).all()  # at most max_new_tokens, all of them labelled
    assert on_policy["teacher_logits"].shape == (*on_policy["input_ids"].shape, len(tokenizer))


def test_lmbda_is_the_fraction_of_on_policy_batches():
    task = GKDTask(teacher="unused", lmbda=0.3)
    batches = 4000
    fraction = sum(task.source_of_batch(i) == "student" for i in range(batches)) / batches
    assert abs(fraction - 0.3) < 4 * (0.3 * 0.7 / batches) ** 0.5  # four binomial standard deviations
    assert {GKDTask(teacher="unused", lmbda=0.0, seq_kd=True).source_of_batch(i) for i in range(100)} == {"teacher"}


def test_a_teacher_with_another_vocabulary_is_refused_naming_both_sizes(tmp_path, tokenizer):
    teacher = save_random_teacher(tmp_path / "wide", tokenizer, len(tokenizer) + 38)
    task = GKDTask(teacher=teacher)
    with pytest.raises(ConfigError, match=rf"vocabulary of {len(tokenizer) + 38} tokens, the student {len(tokenizer)}"):
        task.prepare_model(student(tokenizer, task))


def test_the_example_recipe_passes_the_dry_run_and_a_missing_teacher_is_named(tmp_path, capsys):
    args = ["train", str(EXAMPLE), f"train.output_dir={tmp_path / 'out'}", "--dry-run"]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert cli.main([*args, "task_options.teacher=null"]) == 2  # a ConfigError: fix the input
    assert "task_options.teacher: the gkd task distils from a teacher model" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="task_options.teacher"):
        GKDTask()
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['lamda'\]"):
        GKDTask(teacher="unused", lamda=1.0)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- end to end
def upper_chats(seed: int, count: int) -> list[dict]:
    """"upper: abc" -> "ABC" over three letters of a-h: 512 prompts, so held-out chats are mostly unseen."""
    rng = random.Random(seed)
    words = ("".join(rng.choice("abcdefgh") for _ in range(3)) for _ in range(count))
    return [{"messages": [{"role": "user", "content": f"upper: {w}"}, {"role": "assistant", "content": w.upper()}]}
            for w in words]


def tiny_recipe(root: Path, task: str, hidden_size: int, steps: int, lr: float, output: str) -> dict:
    return {"task": task,
            "model": {"class_name": "TransformersModel", "tokenizer": str(TOKENIZER_DIR),
                      "config": qwen2_config(262, hidden_size)},
            "precision": "no",
            "data": {"train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"), "max_length": 48,
                     "batch_size": 16},
            "optimizer": {"name": "AdamW", "lr": lr, "weight_decay": 0.0},
            "lr_scheduler": {"name": "cosine", "warmup_steps": 10},
            "train": {"output_dir": str(root / output), "max_steps": steps, "seed": 0, "log_every": 50,
                      "eval_before_training": True, "save_total_limit": 1,
                      "evaluate_options": {"max_new_tokens": 8, "batch_size": 32}}}


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    from twinkle_core.train.loop import train

    root = tmp_path_factory.mktemp("gkd")
    for name, rows in (("train.jsonl", upper_chats(0, 512)), ("eval.jsonl", upper_chats(1, 32))):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    teacher = train(tiny_recipe(root, "causal_lm", TEACHER_WIDTH, steps=300, lr=1e-2, output="teacher"))
    recipe = tiny_recipe(root, "gkd", 32, steps=200, lr=3e-2, output="student")
    # forward KL (beta 0): at this size the student learns the copy within 200 steps (JSD's beta 0.5: 0.2 exact match)
    recipe.update(task_options={"teacher": str(root / "teacher" / "final"), "lmbda": 0.5, "max_new_tokens": 8,
                                "temperature": 1.0},
                  loss={"name": "gkd", "options": {"beta": 0.0}})
    (root / "recipe.yaml").write_text(json.dumps(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TWINKLE_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", str(root / "recipe.yaml")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((root / "student" / "summary.json").read_text())
    return teacher, summary, proc.stdout + proc.stderr


@pytest.mark.timeout(420)
def test_a_tiny_student_comes_closer_to_the_teacher_and_learns_its_answers(distilled):
    teacher, summary, console = distilled
    assert teacher["eval_after"]["eval_exact_match"] == 1.0, teacher["eval_after"]  # the teacher knows the task
    before, after = summary["eval_before"], summary["eval_after"]
    print(f"gkd: eval divergence {before['eval_loss']:.3f} -> {after['eval_loss']:.3f}, exact match "
          f"{before['eval_exact_match']:.2f} -> {after['eval_exact_match']:.2f}")
    assert after["eval_loss"] < 0.2 * before["eval_loss"], (before, after)
    assert before["eval_exact_match"] == 0.0 and after["eval_exact_match"] >= 0.75, (before, after)
    assert " on_policy_fraction " in console and " divergence_mean " in console  # the task's headline metrics
    lines = [json.loads(line) for line in (Path(summary["output_dir"]) / "logs.jsonl").read_text().splitlines()]
    fractions = [line["on_policy_fraction"] for line in lines if line["event"] == "train"]
    assert 0.3 < sum(fractions) / len(fractions) < 0.7  # lmbda 0.5: about half the batches sampled by the student
