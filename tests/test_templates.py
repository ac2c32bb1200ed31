"""Named chat templates (``data.template``): assistant-only labels with the project's bundled tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinkle_core.data.chat_templates import BUILTIN_TEMPLATES, resolve_chat_template, template_names
from twinkle_core.data.formats import IGNORE_INDEX, Trajectory
from twinkle_core.errors import ConfigError, DataFormatError

pytest.importorskip("transformers")
QUICKSTART_TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "quickstart" / "tokenizer"
EOS = "<|endoftext|>"

CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "reverse: abc"}, {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "upper: dog"}, {"role": "assistant", "content": "DOG"}]

# what each template trains for the assistant turns of CHAT (content + its end-of-turn marker)
EXPECTED = {
    "chatml": ["cba<|im_end|>", "DOG<|im_end|>"],
    "qwen2.5": ["cba<|im_end|>", "DOG<|im_end|>"],
    "qwen3": ["cba<|im_end|>", "<think>\n\n</think>\n\nDOG<|im_end|>"],
    "llama3": ["cba<|eot_id|>", "DOG<|eot_id|>"],  # not a token of this tokenizer: trained as text
    "mistral": [f"cba{EOS}", f"DOG{EOS}"],
    "glm4": [f"cba{EOS}", f"DOG{EOS}"],
    "internlm2": ["cba<|im_end|>", "DOG<|im_end|>"],
    "deepseek": ["cba<｜end▁of▁sentence｜>", "DOG<｜end▁of▁sentence｜>"],
}


def quickstart_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(QUICKSTART_TOKENIZER))  # fresh: a template is set on it


def spans(feature):
    out, current = [], []
    for token, label in zip(feature.input_ids, feature.labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token
            current.append(token)
        elif current:
            out.append(current)
            current = []
    return out + ([current] if current else [])


def test_every_named_template_is_tested():
    assert sorted(EXPECTED) == sorted(template_names()) == sorted(BUILTIN_TEMPLATES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_template_labels_cover_exactly_the_assistant_tokens(name):
    from twinkle_core.data.template import Template

    tok = quickstart_tokenizer()
    template = Template(tok, chat_template=name)
    assert tok.chat_template == BUILTIN_TEMPLATES[name][0]  # saved with the tokenizer
    feature = template.encode({"messages": CHAT})
    decoded = [tok.decode(span) for span in spans(feature)]
    assert decoded == EXPECTED[name]
    assert tok.decode(feature.input_ids) == tok.apply_chat_template(CHAT, tokenize=False)
    # everything else is masked: the trained tokens are exactly those spans
    assert sum(len(s) for s in spans(feature)) == feature.num_trained_tokens
    # the prompt of the last turn is what the model sees at inference time
    prompt = template.encode_prompt(CHAT[:-1])
    assert feature.input_ids[:len(prompt)] == prompt
    assert feature.labels[len(prompt) - 1] == IGNORE_INDEX and feature.labels[len(prompt)] != IGNORE_INDEX


def test_named_templates_render_each_family_format():
    tok = quickstart_tokenizer()
    text = {}
    for name in EXPECTED:
        tok.chat_template = resolve_chat_template(name)[0]
        text[name] = tok.apply_chat_template(CHAT[1:3], tokenize=False)
    assert text["chatml"] == "<|im_start|>user\nreverse: abc<|im_end|>\n<|im_start|>assistant\ncba<|im_end|>\n"
    assert text["qwen2.5"].startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert text["llama3"] == ("<|start_header_id|>user<|end_header_id|>\n\nreverse: abc<|eot_id|>"
                              "<|start_header_id|>assistant<|end_header_id|>\n\ncba<|eot_id|>")
    assert text["mistral"] == f"[INST] reverse: abc [/INST]cba{EOS}"
    assert text["glm4"] == f"[gMASK]<sop><|user|>\nreverse: abc<|assistant|>\ncba{EOS}"
    assert text["deepseek"] == "<｜User｜>reverse: abc<｜Assistant｜>cba<｜end▁of▁sentence｜>"
    tok.chat_template = resolve_chat_template("mistral")[0]
    assert tok.apply_chat_template(CHAT[:3], tokenize=False).startswith("[INST] Be brief.\n\nreverse: abc [/INST]")


def test_qwen3_drops_the_reasoning_of_earlier_turns():
    from twinkle_core.data.template import Template

    tok = quickstart_tokenizer()
    chat = [{"role": "user", "content": "reverse: abc"},
            {"role": "assistant", "content": "<think>\nreverse it\n</think>\n\ncba"},
            {"role": "user", "content": "upper: dog"},
            {"role": "assistant", "content": "DOG", "reasoning_content": "shout it"}]
    feature = Template(tok, chat_template="qwen3").encode({"messages": chat})
    text = tok.decode(feature.input_ids)
    assert "reverse it" not in text  # the earlier turn's reasoning is gone, as in Qwen3's own template
    assert [tok.decode(s) for s in spans(feature)] == ["cba<|im_end|>", "<think>\nshout it\n</think>\n\nDOG<|im_end|>"]
    # no thinking: the generation prompt holds the empty think block
    template = Template(quickstart_tokenizer(), chat_template="qwen3", chat_template_kwargs={"enable_thinking": False})
    assert template.render(chat[:1], add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_from_a_jinja_file(tmp_path):
    from twinkle_core.data.template import Template

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = quickstart_tokenizer()
    feature = Template(tok, chat_template=str(path)).encode({"messages": CHAT})
    assert [tok.decode(s) for s in spans(feature)] == ["cba<|im_end|>", "DOG<|im_end|>"]


def test_unknown_template_name_suggests():
    with pytest.raises(ConfigError, match=r"data.template: 'qwen-3' is neither a built-in .* did you mean 'qwen3'"):
        resolve_chat_template("qwen-3")


def test_base_tokenizer_without_template_names_the_template_key(tmp_path):
    from twinkle_core.tasks.causal_lm import CausalLMTask

    tok = quickstart_tokenizer()
    tok.chat_template = None
    rows = [{"messages": CHAT}]
    with pytest.raises(ConfigError, match="has no chat template.*data.template"):
        CausalLMTask().load_dataset(rows, tok)
    features = CausalLMTask().load_dataset(rows, tok, template="chatml")
    assert [tok.decode(s) for s in spans(features[0])] == EXPECTED["chatml"]


def test_a_template_that_cannot_render_a_row_names_the_line(tmp_path):
    from twinkle_core.tasks.causal_lm import CausalLMTask

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}"
                    "{% endif %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    data = tmp_path / "d.jsonl"
    import json

    data.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": [
        {"role": "user", "content": "x"}, {"role": "tool", "content": "y"}, {"role": "assistant", "content": "z"}]})
        + "\n")
    with pytest.raises(DataFormatError, match="d.jsonl:2: the chat template cannot render.*no tools here"):
        CausalLMTask().load_dataset(str(data), quickstart_tokenizer(), template=str(path))
    assert Trajectory.from_dict({"messages": CHAT}).messages[0].role == "system"
