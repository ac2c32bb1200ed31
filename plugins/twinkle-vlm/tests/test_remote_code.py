"""Issue 27 point 1: a processor's own code never runs with the switch off, and nothing asks on stdin.

Every kind of directory :func:`twinkle_vlm.processor.load_processor` reads (the processor, its tokenizer, an image
processor, the model config the processor class is looked up from) gets ``auto_map`` custom code whose module
writes a marker file when imported. Each load runs in a subprocess whose stdin answers "y" to transformers'
"Do you wish to run the custom code? [y/N]" and with ``TWINKLE_TRUST_REMOTE_CODE=0``: it must be refused with an
error naming the switches, the marker must never appear, and nothing may prompt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

#: imported by transformers only when it runs the directory's code
CUSTOM_MODULE = textwrap.dedent("""
    import os

    with open(os.environ["TWINKLE_TEST_MARKER"], "a") as marker:
        marker.write(__name__ + "\\n")


    class {name}:
        pass
""")

#: loads a processor the way the vlm task does; the options come as JSON in argv[1], the model dir in argv[2]
LOAD = textwrap.dedent("""
    import json
    import sys

    from twinkle_core.errors import ConfigError
    from twinkle_core.testing.tiny_tokenizer import build_tiny_tokenizer
    from twinkle_vlm.processor import load_processor

    tokenizer = build_tiny_tokenizer()
    tokenizer.name_or_path = sys.argv[2]
    try:
        load_processor(tokenizer, json.loads(sys.argv[1]))
    except ConfigError as exc:
        print("REFUSED:", exc)
        sys.exit(3)
    print("LOADED")
""")


def _plant(directory: Path, config_file: str, content: dict, module: str, name: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / config_file).write_text(json.dumps(content))
    (directory / f"{module}.py").write_text(CUSTOM_MODULE.format(name=name))
    return directory


def _qwen2_vl_processor_files(directory: Path) -> None:
    """A real processor class and image processor (no model config: the tokenizer has no built-in class to
    fall back on), so only the planted tokenizer code is custom."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    (directory / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
         "temporal_patch_size": 2}))


def _cases(root: Path) -> dict[str, tuple[dict, Path]]:
    """``kind -> (task options, the model directory the tokenizer names)``."""
    plain_model = root / "plain_model"
    plain_model.mkdir()
    (plain_model / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    processor = _plant(root / "processor", "processor_config.json",
                       {"processor_class": "EvilProcessor",
                        "auto_map": {"AutoProcessor": "processing_evil.EvilProcessor"}},
                       "processing_evil", "EvilProcessor")
    tokenizer = root / "tokenizer"
    _qwen2_vl_processor_files(tokenizer)
    _plant(tokenizer, "tokenizer_config.json",
           {"tokenizer_class": "EvilTokenizer",
            "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}},
           "tokenization_evil", "EvilTokenizer")
    image_processor = _plant(root / "image_processor", "preprocessor_config.json",
                             {"image_processor_type": "EvilImageProcessor",
                              "auto_map": {"AutoImageProcessor": "image_processing_evil.EvilImageProcessor"}},
                             "image_processing_evil", "EvilImageProcessor")
    config = _plant(root / "config", "config.json",
                    {"model_type": "evil_vlm", "auto_map": {"AutoConfig": "configuration_evil.EvilConfig"}},
                    "configuration_evil", "EvilConfig")
    mapping = {"image_processor_type": "Qwen2VLImageProcessorPil", "patch_size": 14, "merge_size": 2}
    return {
        "processor (task_options.processor)": ({"processor": str(processor)}, plain_model),
        "processor (the model directory)": ({}, processor),
        "tokenizer of the processor": ({"processor": str(tokenizer)}, plain_model),
        "image processor (task_options.image_processor)": ({"image_processor": str(image_processor)}, plain_model),
        "model config (processor class lookup)": ({"image_processor": mapping}, config),
    }


def _run(options: dict, model_dir: Path, tmp_path: Path, marker: Path, trust: str) -> subprocess.CompletedProcess:
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    env = {**os.environ, "TWINKLE_TRUST_REMOTE_CODE": trust, "TWINKLE_TEST_MARKER": str(marker),
           "HF_MODULES_CACHE": str(tmp_path / "hf_modules"), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(script), json.dumps(options), str(model_dir)], input="y\n",
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def planted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, Path]]:
    return _cases(tmp_path_factory.mktemp("planted"))


@pytest.mark.parametrize("kind", ["processor (task_options.processor)", "processor (the model directory)",
                                  "tokenizer of the processor", "image processor (task_options.image_processor)",
                                  "model config (processor class lookup)"])
def test_custom_code_is_refused_without_asking(planted: dict, kind: str, tmp_path: Path) -> None:
    options, model_dir = planted[kind]
    marker = tmp_path / "marker"
    done = _run(options, model_dir, tmp_path, marker, trust="0")
    output = done.stdout + done.stderr
    assert not marker.exists(), f"{kind}: the planted code ran ({marker.read_text()!r}):\n{output}"
    assert "[y/N]" not in output, f"{kind}: transformers asked on stdin:\n{output}"
    assert done.returncode == 3, f"{kind}: not refused (rc {done.returncode}):\n{output}"
    assert "TWINKLE_TRUST_REMOTE_CODE=1" in output and "model.trust_remote_code: true" in output, output
    assert "Traceback" not in output, output


def test_the_switch_on_runs_the_code_without_asking(planted: dict, tmp_path: Path) -> None:
    """With the switch on the processor's code is imported (the planted class is no processor, so the load
    fails afterwards), and still nothing asks."""
    options, model_dir = planted["processor (task_options.processor)"]
    marker = tmp_path / "marker"
    done = _run(options, model_dir, tmp_path, marker, trust="1")
    output = done.stdout + done.stderr
    assert marker.exists(), output
    assert "[y/N]" not in output, output


def test_refuse_custom_code_reads_every_config_kind(tmp_path: Path) -> None:
    from twinkle_vlm.processor import CUSTOM_CODE_FILES, refuse_custom_code

    from twinkle_core.errors import ConfigError

    for name in CUSTOM_CODE_FILES:
        directory = tmp_path / name.replace(".", "_")
        directory.mkdir()
        (directory / name).write_text(json.dumps({"auto_map": {"AutoConfig": "x.Y"}}))
        with pytest.raises(ConfigError, match=name):
            refuse_custom_code(directory, "the directory", False)
        refuse_custom_code(directory, "the directory", True)  # the switch on: accepted
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))
    refuse_custom_code(tmp_path / "plain", "the directory", False)
