"""Built-in chat templates, chosen by name with the recipe's ``data.template`` (or a Jinja file).

``data.template: NAME`` replaces the tokenizer's chat template for training, evaluation and the
saved checkpoint (the tokenizer is saved with it). Names (:func:`template_names`):

* ``chatml``: ``<|im_start|>role\\n...<|im_end|>\\n``, no default system prompt
* ``qwen2.5`` (also ``qwen2``, ``qwen``): ChatML with Qwen2.5's default system prompt
* ``qwen3``: ChatML as Qwen3 writes it: the reasoning of an assistant turn (``reasoning_content``, or
  ``<think>...</think>`` at the start of its content) is rendered as ``<think>\\n...\\n</think>\\n\\n``
  only for turns after the last user message; earlier turns lose it, as Qwen3's own template does
  (so earlier turns are trained without their reasoning). ``enable_thinking: false`` in the
  template arguments adds the empty ``<think>`` block to the generation prompt.
* ``llama3``: ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>`` after the BOS token
* ``mistral``: ``[INST] user [/INST]assistant</s>`` (a system message is put before the first user
  message, separated by a blank line)
* ``glm4``: ``[gMASK]<sop><|role|>\\n...``; GLM-4's own template has no end-of-turn marker (the model
  stops on ``<|user|>``), so this one ends every assistant turn with the tokenizer's EOS token to
  teach the model where a turn ends
* ``internlm2``: ChatML after the BOS token
* ``deepseek``: DeepSeek-V3: ``<｜User｜>...<｜Assistant｜>...<｜end▁of▁sentence｜>``

The built-in templates render the roles system / user / assistant / tool; they do not render
tool definitions (``tools``): for tool calling keep the model's own template or pass a file.
Anything else is read as the path of a Jinja file. The end-of-turn marker of a named template
(:func:`end_of_turn_of`) is trained with every assistant turn; when it is not a single token of the
tokenizer a warning says so (the model would learn it as plain text).
"""

from __future__ import annotations

import os

from twinkle_core.errors import ConfigError

_BOS = "{% if bos_token %}{{ bos_token }}{% endif %}"

_CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_QWEN25 = (
    "{%- if not messages or messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + _CHATML
)

_QWEN3 = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- set content = message['content'] %}"
    "{%- set reasoning = message.get('reasoning_content') or '' %}"
    "{%- if not reasoning and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n')"
    " + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_LLAMA3 = (
    _BOS + "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_MISTRAL = (
    _BOS + "{%- set ns = namespace(system='') %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- set ns.system = message['content'] + '\\n\\n' %}"
    "{%- elif message['role'] == 'user' %}{{- '[INST] ' + ns.system + message['content'] + ' [/INST]' }}"
    "{%- set ns.system = '' %}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}"
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS] ' + message['content'] + ' [/TOOL_RESULTS]' }}"
    "{%- endif %}"
    "{%- endfor %}"
)

_GLM4 = (
    "[gMASK]<sop>"
    "{%- for message in messages %}"
    "{%- set role = 'observation' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|' + role + '|>\\n' + message['content'] }}"
    "{%- if message['role'] == 'assistant' %}{{- eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

_INTERNLM2 = _BOS + _CHATML

_DEEPSEEK = (
    _BOS + "{%- for message in messages %}{%- if message['role'] == 'system' %}{{- message['content'] }}"
    "{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content']"
    " + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

#: name -> (Jinja source, end-of-turn marker; ``None``: the tokenizer's EOS token)
BUILTIN_TEMPLATES: dict[str, tuple[str, str | None]] = {
    "chatml": (_CHATML, "<|im_end|>"),
    "qwen2.5": (_QWEN25, "<|im_end|>"),
    "qwen3": (_QWEN3, "<|im_end|>"),
    "llama3": (_LLAMA3, "<|eot_id|>"),
    "mistral": (_MISTRAL, None),
    "glm4": (_GLM4, None),
    "internlm2": (_INTERNLM2, "<|im_end|>"),
    "deepseek": (_DEEPSEEK, "<｜end▁of▁sentence｜>"),
}
ALIASES = {"qwen2": "qwen2.5", "qwen": "qwen2.5", "qwen25": "qwen2.5", "llama-3": "llama3", "llama3.1": "llama3",
           "glm-4": "glm4", "internlm": "internlm2", "deepseek3": "deepseek", "deepseek-v3": "deepseek"}


def template_names() -> list[str]:
    return list(BUILTIN_TEMPLATES)


def _canonical(name: str) -> str | None:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in BUILTIN_TEMPLATES else None


def resolve_chat_template(value: str, where: str = "data.template") -> tuple[str, str | None, str]:
    """``(Jinja source, end-of-turn marker or None, label)`` for a built-in name or a Jinja file path."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: expected a template name ({', '.join(template_names())}) or a Jinja file path, "
                          f"got {value!r}")
    name = _canonical(value)
    if name is not None:
        source, end = BUILTIN_TEMPLATES[name]
        return source, end, name
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        if not source.strip():
            raise ConfigError(f"{where}: the template file {value!r} is empty")
        return source, None, path
    import difflib

    close = difflib.get_close_matches(value.lower(), [*template_names(), *ALIASES], n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"{where}: {value!r} is neither a built-in chat template ({', '.join(template_names())}) nor "
                      f"an existing Jinja file{hint}")


__all__ = ["ALIASES", "BUILTIN_TEMPLATES", "resolve_chat_template", "template_names"]
