"""The commands for after training: ``twinkle chat``, ``export``, ``eval`` and ``plot``.

One module-scoped run trains the quickstart model for 2 steps (full fine-tune), and a second one trains a LoRA
adapter on top of that checkpoint (so adapter_config.json records a local base); the tests use both.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from twinkle_core.cli import main

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "quickstart" / "recipe.yaml"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
       "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}

pytest.importorskip("twinkle_backend_hf")
pytest.importorskip("peft")


def twinkle(*args: str, stdin: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twinkle_core.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=600, env={**ENV, **(env or {})}, cwd=ROOT)


def _train(out: Path, eval_file: Path, *extra: str) -> None:
    result = twinkle("train", str(RECIPE), f"train.output_dir={out}", "train.max_steps=2",
                     "train.eval_before_training=false", "data.batch_size=4", f"data.eval={eval_file}", *extra)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("commands")
    eval_file = root / "eval.jsonl"
    eval_file.write_text("".join((ROOT / "examples" / "quickstart" / "eval.jsonl").read_text()
                                 .splitlines(keepends=True)[:4]))
    _train(root / "full", eval_file)
    _train(root / "lora", eval_file, f"model.model_id={root / 'full' / 'final'}",
           "model.adapter={r: 4, lora_alpha: 8, target_modules: all-linear}", "optimizer.lr=0.05")
    return {"root": root, "eval": eval_file, "full": root / "full", "lora": root / "lora" / "final"}


def _reference_answer(path: Path, prompt: str, max_new_tokens: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=[0, tok.convert_tokens_to_ids("<|im_end|>")])
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


# ---------------------------------------------------------------------- chat
def test_chat_prompt_one_shot_matches_plain_transformers(runs):
    # the Twinkle output directory resolves to its final checkpoint
    result = twinkle("chat", str(runs["full"]), "--prompt", "reverse: abc", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "using checkpoint" in result.stderr and "final" in result.stderr
    assert result.stdout.strip() == _reference_answer(runs["full"] / "final", "reverse: abc", 8)
    # its torch threads, chosen like a training process's (twinkle_core.threads) and said on stderr
    threads = os.environ.get("TWINKLE_TEST_THREADS")
    said = f"twinkle: torch threads: {threads} (from TWINKLE_TEST_THREADS;" if threads else "twinkle: torch threads:"
    assert said in result.stderr, result.stderr


def test_chat_interactive_reset_and_exit(runs):
    result = twinkle("chat", str(runs["lora"]), "--system", "be brief", "--max-new-tokens", "4",
                     stdin="upper: ab\n/reset\nreverse: x\n/exit\nnever read\n")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "/reset" in result.stdout and "(conversation reset)" in result.stdout
    assert result.stdout.count(">>> ") == 4  # two questions, /reset, /exit: nothing after /exit is read


def test_chat_session_keeps_turns_and_resets(runs):
    from twinkle_backend_hf.commands.chat import ChatSession, interact
    from twinkle_backend_hf.commands.checkpoint_loading import load_model, load_tokenizer, resolve_checkpoint

    ckpt = resolve_checkpoint(runs["lora"])
    assert ckpt.kind == "adapter" and ckpt.base == str(runs["full"] / "final")
    session = ChatSession(load_model(ckpt), load_tokenizer(ckpt), system="sys", max_new_tokens=3)
    first = session.ask("upper: ab")  # a 2-step model may answer "" (it ends the turn at once)
    assert isinstance(first, str) and [m["role"] for m in session.messages] == ["system", "user", "assistant"]
    session.ask("again")
    assert [m["role"] for m in session.messages] == ["system", "user", "assistant", "user", "assistant"]
    out: list[str] = []
    feed = iter(["/reset", "", "/exit"])
    interact(session, read=lambda _: next(feed), write=out.append)
    assert session.messages == [{"role": "system", "content": "sys"}]
    assert "(conversation reset)" in out


@pytest.mark.parametrize("argv, message", [
    (["chat", "/no/such/dir", "--prompt", "x"], "does not exist"),
    (["chat", "README.md", "--prompt", "x"], "is a file, not a directory"),
    (["chat", "examples", "--prompt", "x"], "is not a checkpoint"),
    (["chat", "examples/quickstart/tokenizer", "--prompt", "x", "--temperature", "-1"], "--temperature"),
    (["export", "examples/quickstart/tokenizer"], "--output DIR"),
    (["eval", "examples/quickstart/tokenizer"], "needs DATA"),
    (["plot", "/no/such/logs.jsonl"], "no such log"),
])
def test_clear_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "twinkle: error:" in err and message in err, err


def test_adapter_without_base_names_the_fix(runs, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    shutil.copytree(runs["lora"], adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = None
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert main(["chat", str(adapter), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "records no base model" in err and "--base DIR" in err
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    assert main(["export", str(adapter), "--merge-lora", "-o", str(tmp_path / "x")]) == 2
    assert "does not exist; pass the base model directory with --base DIR" in capsys.readouterr().err


# ---------------------------------------------------------------------- export
def test_export_merge_lora_gives_the_peft_models_logits(runs, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    result = twinkle("export", str(runs["lora"]), "--merge-lora", "--output", str(out), "--max-shard-size", "200KB")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*.safetensors"))) > 1  # sharded
    assert not (out / "adapter_config.json").exists() and not (out / "twinkle_checkpoint.json").exists()
    assert json.loads((out / "config.json").read_text())["use_cache"] is True

    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template([{"role": "user", "content": "reverse: galaxy"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(runs["full"] / "final", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, runs["lora"]).eval()
    with torch.no_grad():
        expected = peft_model(**ids).logits
        got = merged(**ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits = peft_model(**ids).logits
    assert (base_logits - expected).abs().max() > 1e-4, "the adapter changed nothing: the test proves nothing"


def test_export_adapter_without_merge_and_full_model(runs, tmp_path):
    result = twinkle("export", str(runs["lora"]), "-o", str(tmp_path / "adapter"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert (tmp_path / "adapter" / "tokenizer.json").is_file()
    result = twinkle("export", str(runs["full"] / "final"), "-o", str(tmp_path / "full"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "full" / "model.safetensors").is_file()
    assert not (tmp_path / "full" / "twinkle_checkpoint.json").exists()
    again = twinkle("export", str(runs["full"] / "final"), "-o", str(tmp_path / "full"))
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_push_to_hub_without_a_token_names_hf_token(runs, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    assert main(["export", str(runs["lora"]), "--merge-lora", "--push-to-hub", "me/model"]) == 2
    assert "HF_TOKEN" in capsys.readouterr().err


def test_push_to_hub_uploads_the_export(runs, tmp_path, monkeypatch):
    import huggingface_hub

    calls = []

    def create_repo(self, repo_id, **kwargs):
        calls.append(("create_repo", repo_id, kwargs, self.token))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(self, *, folder_path, repo_id, **kwargs):
        calls.append(("upload_folder", repo_id, sorted(os.listdir(folder_path)), self.token))

    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    assert main(["export", str(runs["lora"]), "--merge-lora", "--push-to-hub", "me/model", "--private"]) == 0
    assert calls[0][0] == "create_repo" and calls[0][1] == "me/model" and calls[0][2]["private"] is True
    assert calls[0][3] == "hf_test_token"
    assert calls[1][0] == "upload_folder" and calls[1][1] == "me/model"
    assert "config.json" in calls[1][2] and "tokenizer.json" in calls[1][2]
    assert "adapter_config.json" not in calls[1][2]


# ---------------------------------------------------------------------- eval
def test_eval_matches_trainings_eval_loss_and_writes_json(runs, tmp_path):
    out = tmp_path / "results.json"
    result = twinkle("eval", str(runs["full"] / "final"), str(runs["eval"]), "--output", str(out),
                     "--max-new-tokens", "8", "--batch-size", "3", env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "twinkle: torch threads: 1 (from OMP_NUM_THREADS;" in result.stderr
    for word in ("loss", "perplexity", "exact_match"):
        assert word in result.stdout
    data = json.loads(out.read_text())
    metrics = data["metrics"]
    assert metrics["num_examples"] == 4 and metrics["num_exact_match_examples"] == 4
    logged = [json.loads(line) for line in (runs["full"] / "logs.jsonl").read_text().splitlines()]
    eval_loss = [r["eval_loss"] for r in logged if r.get("event") == "eval"][-1]
    eval_em = [r["eval_exact_match"] for r in logged if r.get("event") == "eval"][-1]
    assert metrics["loss"] == pytest.approx(eval_loss, rel=1e-4)  # labelled as twinkle train labels them
    assert metrics["perplexity"] == pytest.approx(float(__import__("math").exp(metrics["loss"])))
    assert metrics["exact_match"] == pytest.approx(eval_em)
    assert len(data["predictions"]) == 4 and data["predictions"][0]["reference"] == "JVYSJW"


def test_eval_exact_match_counts_correct_answers(runs, tmp_path):
    # rows whose reference is what the model answers: exact match 1.0
    ref = _reference_answer(runs["full"] / "final", "reverse: abc", 8)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "reverse: abc"},
                                             {"role": "assistant", "content": ref}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user", "content": "reverse: abc"},
                                               {"role": "assistant", "content": ref + "zzz"}]}) + "\n")
    out = tmp_path / "r.json"
    assert main(["eval", str(runs["full"]), str(rows), "-o", str(out), "--max-new-tokens", "8"]) == 0
    assert json.loads(out.read_text())["metrics"]["exact_match"] == 0.5


def test_eval_text_rows(runs, tmp_path):
    rows = tmp_path / "text.jsonl"
    rows.write_text(json.dumps({"text": "hello world"}) + "\n" + json.dumps({"text": "abc"}) + "\n")
    out = tmp_path / "r.json"
    assert main(["eval", str(runs["lora"]), str(rows), "-o", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics["num_examples"] == 2 and metrics["loss"] > 0 and "exact_match" not in metrics


def test_eval_tasks_without_lm_eval_says_pip_install(runs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError
    assert main(["eval", str(runs["full"]), "--tasks", "hellaswag"]) == 2
    assert "pip install lm-eval" in capsys.readouterr().err


LM_TASK = """task: twinkle_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{question}}}}"
doc_to_target: " {{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def test_eval_runs_a_local_lm_eval_task(runs, tmp_path):
    pytest.importorskip("lm_eval")
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps({"question": f"reverse: {w}", "answer": w[::-1]}) + "\n"
                            for w in ("abc", "xy", "hello")))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "twinkle_tiny.yaml").write_text(LM_TASK.format(data=data))
    out = tmp_path / "r.json"
    result = twinkle("eval", str(runs["full"]), "--tasks", "twinkle_tiny", "--include-path", str(tasks),
                     "-o", str(out), env={"HF_DATASETS_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads(out.read_text())["lm_eval"]["twinkle_tiny"]
    assert "acc,none" in metrics and 0.0 <= metrics["acc,none"] <= 1.0
    assert "twinkle_tiny/acc,none" in result.stdout


def test_eval_tasks_offline_without_the_data_set_says_how_to_provide_it(runs, tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty_cache"))  # nothing cached: the offline case
    assert main(["eval", str(runs["full"]), "--tasks", "arc_easy", "--limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "twinkle: error: --tasks arc_easy: lm-eval could not load the task's data set (" in err
    assert "Hugging Face datasets cache" in err and "--include-path DIR" in err


# ---------------------------------------------------------------------- plot
def test_plot_writes_a_png(runs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    result = twinkle("plot", str(runs["full"] / "logs.jsonl"), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["plot", str(runs["full"]), "--keys", "loss,grad_norm", "-o", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "b.png").is_file()


def test_plot_unknown_key_lists_the_available_ones(runs, capsys):
    assert main(["plot", str(runs["full"]), "--keys", "los"]) == 2
    err = capsys.readouterr().err
    assert "no 'los'" in err and "loss" in err


def test_help_imports_no_torch():
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "twinkle_core.cli", "eval", "--help"],
                            capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and "--tasks" in result.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in result.stderr.splitlines() if "|" in line}
    assert not imported & {"torch", "transformers", "peft", "matplotlib"}
