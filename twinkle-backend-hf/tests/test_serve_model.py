"""``twinkle serve-model``: the real server in a subprocess, driven by the real ``openai`` client.

The served model (:mod:`ok_model`) answers "ok" and then the end-of-turn token ``<|im_end|>`` after the chat
template's generation prompt (after any newline), and "xxx..." after anything else; its LoRA adapter answers "k".
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ok_model import TOKENIZER, build_k_adapter, build_ok_model

from twinkle_core.errors import ConfigError

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
       "TOKENIZERS_PARALLELISM": "false", "DS_ACCELERATOR": "cpu"}
NAME = "tiny-ok"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """``twinkle serve-model`` in a subprocess; stopped by :meth:`stop` whatever happened."""

    def __init__(self, checkpoint: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "twinkle_core.cli", "serve-model", str(checkpoint), "--port", str(self.port),
                 "--device", "cpu", *extra], stdout=out, stderr=subprocess.STDOUT, env=ENV, cwd=ROOT)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"serve-model exited with {self.process.returncode}:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        raise AssertionError(f"serve-model did not answer within {timeout} s:\n{self.log.read_text()}")

    def client(self):
        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)


def _serve(checkpoint: Path, log: Path, *extra: str):
    server = Server(checkpoint, log, *extra)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    base = build_ok_model(root / "ok")
    return {"root": root, "base": base, "adapter": build_k_adapter(base, root / "k-adapter")}


@pytest.fixture(scope="module")
def server(models):
    yield from _serve(models["base"], models["root"] / "server.log", "--model-name", NAME)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


# ---------------------------------------------------------------------- the endpoints
def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_answers_and_stops_at_the_end_of_turn(client):
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
    (choice,) = answer.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "ok", "stop")
    assert answer.object == "chat.completion" and answer.model == NAME
    # "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n": 10 tokens; "o", "k" and <|im_end|> generated
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (10, 3, 13)


def test_chat_stream(client):
    chunks = list(client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "ok" and "<|im_end|>" not in text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "stop" and reasons[:-1] == [None] * (len(reasons) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_stream_ends_with_done(server):
    request = urllib.request.Request(f"{server.url}/chat/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                      "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=60) as answer:
        events = [line for line in answer.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_max_tokens_finishes_with_length_and_stop_strings_cut(client):
    messages = [{"role": "user", "content": "hi"}]
    short = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1)
    assert (short.choices[0].message.content, short.choices[0].finish_reason) == ("o", "length")
    newer = client.chat.completions.create(model=NAME, messages=messages, max_completion_tokens=1)
    assert newer.choices[0].message.content == "o"
    cut = client.chat.completions.create(model=NAME, messages=messages, stop=["k"])
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("o", "stop")
    streamed = client.chat.completions.create(model=NAME, messages=messages, stop="ok", stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""  # the held-back "o" was a stop's start
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_seed_and_sampling(client):
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], n=2,
                                            temperature=1.0, top_p=0.9, seed=3)
    assert [(c.index, c.message.content, c.finish_reason) for c in answer.choices] == [(0, "ok", "stop"),
                                                                                       (1, "ok", "stop")]
    assert answer.usage.prompt_tokens == 20 and answer.usage.completion_tokens == 6


def test_completions(client):
    answer = client.completions.create(model=NAME, prompt="q\n", temperature=0)
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("ok", "stop")
    assert answer.object == "text_completion" and answer.usage.prompt_tokens == 2
    babble = client.completions.create(model=NAME, prompt="abc", max_tokens=4, temperature=0)
    assert (babble.choices[0].text, babble.choices[0].finish_reason) == ("xxxx", "length")
    default = client.completions.create(model=NAME, prompt="abc", temperature=0)
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens of /v1/completions
    chunks = list(client.completions.create(model=NAME, prompt="q\n", stream=True, temperature=0))
    assert "".join(c.choices[0].text for c in chunks) == "ok" and chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"temperature": 3}, "temperature"),
])
def test_unsupported_fields_are_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], extra_body=extra)
    error = caught.value.body  # the client hands out the "error" object
    assert caught.value.status_code == 400 and error["param"] == param and param in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def test_off_values_and_unknown_model(client):
    answer = client.chat.completions.create(model=NAME, messages=[{"role": "developer", "content": "be brief"},
                                                                  {"role": "user", "content": "hi"}],
                                            logprobs=False, frequency_penalty=0.0, tools=[])
    assert answer.choices[0].message.content == "ok"
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="abc", echo=True)
    assert caught.value.body["param"] == "echo"


def test_an_adapter_checkpoint_is_served_on_its_base(models, tmp_path):
    for server in _serve(models["adapter"], tmp_path / "adapter.log"):
        answer = server.client().chat.completions.create(model="k-adapter",
                                                         messages=[{"role": "user", "content": "hi"}])
        assert (answer.choices[0].message.content, answer.choices[0].finish_reason) == ("k", "stop")


def test_requests_wait_for_each_other(client):
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> str:
        chunks = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": f"hi {i}"}],
                                                stream=i % 2 == 0)
        if i % 2:
            return chunks.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in chunks)

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(ask, range(4))) == ["ok"] * 4


# ---------------------------------------------------------------------- without a server
def test_greedy_loop_matches_generate_on_a_random_model():
    """The KV-cache loop gives what ``model.generate`` gives: attention and positions matter in this model."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from twinkle_backend_hf.commands.text_generation import SamplingOptions, TextGenerator

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.manual_seed(1)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256)).eval()
    prompt = tokenizer("reverse: abc\n")["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    expected = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)
    answer = TextGenerator(model, tokenizer, stop_ids=[]).complete(prompt, SamplingOptions(max_tokens=24))
    assert (answer.text, answer.finish_reason, answer.completion_tokens) == (expected, "length", 24)
    assert len(set(out[0, len(prompt):].tolist())) > 3  # a model that says more than one thing


def test_missing_fastapi_names_the_extra(monkeypatch):
    import importlib.util

    from twinkle_backend_hf.commands import serve_model

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fastapi" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs fastapi.*pip install 'twinkle-backend-hf\[serve\]'"):
        serve_model.require_serve_dependencies()


def test_text_is_held_back_while_it_may_become_a_stop_string():
    from twinkle_backend_hf.commands.text_generation import first_stop, settled_length

    assert settled_length("hello wor", ["world"]) == len("hello ")
    assert settled_length("hello", ["world"]) == len("hello")
    assert settled_length("caf\ufffd", []) == 3  # an incomplete UTF-8 character waits for its other bytes
    assert first_stop("a STOP b END", ["END", "STOP"]) == 2 and first_stop("abc", ["x"]) is None
