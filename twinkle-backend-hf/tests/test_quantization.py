"""QLoRA (a bitsandbytes 4-bit / 8-bit base, LoRA adapters trained on it) and ``twinkle export --quantize``, on CPU.

bitsandbytes >= 0.46 runs its 4-bit and 8-bit layers on CPU (torch kernels), so everything here runs without a
GPU; GPTQ / AWQ need one and are only checked to be refused (bench/gpu_check_quantize.py is their GPU check).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

import transformers  # noqa: E402
from twinkle_backend_hf import quantization  # noqa: E402
from twinkle_backend_hf.model import TransformersModel  # noqa: E402
from twinkle_backend_hf.testing import tiny_qwen2_config  # noqa: E402

from twinkle_core.cli import main  # noqa: E402
from twinkle_core.errors import ConfigError  # noqa: E402
from twinkle_core.testing.conformance import LORA_CONFIG, make_batch  # noqa: E402
from twinkle_core.testing.tolerance import forward_tolerance  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples" / "quickstart" / "tokenizer"
STEPS = 6


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny Qwen2 (hidden 64) saved as a plain transformers directory with the quickstart's tokenizer."""
    path = tmp_path_factory.mktemp("quantization") / "base"
    config = transformers.AutoConfig.for_model(**tiny_qwen2_config(vocab_size=262, hidden_size=64,
                                                                   intermediate_size=128))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)
    return path


def _train(model, steps=STEPS):
    model.add_adapter_to_model("default", copy.deepcopy(LORA_CONFIG))
    model.set_optimizer("AdamW", lr=1e-2)
    batch = make_batch(0)
    losses = []
    for _ in range(steps):
        out = model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        losses.append(float(out["loss"]))
    return losses, batch


@pytest.fixture(scope="module")
def qlora(base_dir, tmp_path_factory):
    model = TransformersModel(model_id=str(base_dir), quantization={"bits": 4, "quant_type": "nf4"})
    losses, batch = _train(model)
    path = model.save("final", output_dir=str(tmp_path_factory.mktemp("qlora-run")), adapter_name="default",
                      save_optimizer=False)
    return types.SimpleNamespace(model=model, losses=losses, batch=batch, path=Path(path))


# ---------------------------------------------------------------------- QLoRA training
def test_qlora_trains_lora_on_a_frozen_4bit_base(qlora):
    layer = qlora.model.hf_model.model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(layer, bnb.nn.Linear4bit) and isinstance(layer.weight, bnb.nn.Params4bit)
    assert layer.weight.quant_type == "nf4" and layer.weight.dtype == torch.uint8  # packed 4-bit values
    quantised = [m for m in qlora.model.hf_model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantised) == 2 * 7  # every q/k/v/o/gate/up/down projection of both layers; the LM head stays fp32
    trainable = [n for n, p in qlora.model.module.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert qlora.losses[-1] < qlora.losses[0] - 0.1, qlora.losses  # lr 1e-2 on one batch: a clear descent
    assert all(b < a for a, b in zip(qlora.losses, qlora.losses[1:])), qlora.losses
    assert qlora.model.describe()["quantization"]["bits"] == 4


def test_the_saved_adapter_is_plain_peft_on_the_unquantised_base(qlora, base_dir):
    import peft
    from safetensors.torch import load_file

    config = json.loads((qlora.path / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]).resolve() == base_dir.resolve()
    saved = load_file(qlora.path / "adapter_model.safetensors")
    plain = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir), qlora.path)
    weights = {k: v for k, v in plain.state_dict().items() if "lora_" in k}
    assert len(weights) == len(saved) > 0
    for key, value in saved.items():  # peft names them with the adapter name inserted
        torch.testing.assert_close(weights[key.replace(".weight", ".default.weight")], value, rtol=0, atol=0)
    # on a base quantised the same way (quantisation is deterministic) it computes exactly what training computed
    quantised_base = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, **quantization.load_kwargs(quantization.QuantizationSettings(bits=4), "cpu"))
    reloaded = peft.PeftModel.from_pretrained(quantised_base, qlora.path).eval()
    batch = qlora.batch
    with torch.no_grad():
        got = reloaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, qlora.model.forward_only(inputs=batch)["logits"], rtol=0, atol=0)


def test_gradient_checkpointing_gives_the_same_qlora_steps(qlora, base_dir):
    model = TransformersModel(model_id=str(base_dir), quantization={"bits": 4}, gradient_checkpointing=True)
    losses, _ = _train(model, steps=3)
    assert model.hf_model.is_gradient_checkpointing
    # the first step's loss is one forward of the same weights (LoRA B starts at zero): equal up to the order of
    # its sums, the widest being the log-softmax over the vocabulary; then the steps train as without checkpointing
    bound = forward_tolerance(qlora.losses[0], width=262, depth=2)
    assert abs(losses[0] - qlora.losses[0]) <= bound, (losses, qlora.losses)
    assert losses[2] < losses[1] < losses[0], losses


@pytest.mark.parametrize("options", [{"load_in_8bit": True}, {"quantization_bit": 8}, {"quantization": "8bit"}])
def test_the_8bit_aliases_train_lora_on_an_int8_base(base_dir, options):
    model = TransformersModel(model_id=str(base_dir), **options)
    layer = model.hf_model.model.layers[0].mlp.down_proj
    assert isinstance(layer, bnb.nn.Linear8bitLt) and layer.weight.dtype == torch.int8
    losses, _ = _train(model, steps=3)
    assert losses[-1] < losses[0], losses


def test_the_4bit_aliases_give_the_same_settings():
    expected = quantization.QuantizationSettings(bits=4)
    assert quantization.settings_from_options(load_in_4bit=True) == expected
    assert quantization.settings_from_options(quantization_bit=4) == expected
    assert quantization.settings_from_options(4) == expected
    assert quantization.settings_from_options({"bits": 4}, load_in_4bit=True, quantization_bit=4) == expected
    assert quantization.settings_from_options() is None
    config = quantization.settings_from_options({"bits": 4, "compute_dtype": "bfloat16", "quant_type": "fp4",
                                                 "double_quant": True}).bnb_config()
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "fp4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == torch.bfloat16


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize(("options", "message"), [
    ({"quantization": {"bits": 3}}, r"bits must be 4 or 8"),
    ({"quantization": True}, r"does not say how many bits"),
    ({"quantization": {"bits": 4, "group": 2}}, r"unknown key\(s\) group; known: bits"),
    ({"quantization": {"bits": 4, "quant_type": "int4"}}, r"quant_type must be one of nf4, fp4"),
    ({"quantization": {"bits": 4, "compute_dtype": "fp16"}}, r"compute_dtype must be one of float32"),
    ({"quantization": {"bits": 8, "quant_type": "nf4"}}, r"apply to 4-bit only"),
    ({"load_in_4bit": True, "load_in_8bit": True}, r"load_in_4bit \(4-bit\), load_in_8bit \(8-bit\); keep one"),
    ({"quantization": 4, "quantization_bit": 8}, r"quantization \(4-bit\), quantization_bit \(8-bit\)"),
    ({"quantization_bit": 2}, r"quantization_bit must be 4 or 8"),
    ({"load_in_4bit": "yes"}, r"load_in_4bit must be true or false"),
])
def test_invalid_settings_are_refused_by_the_recipe_check_and_the_constructor(base_dir, options, message):
    with pytest.raises(ConfigError, match=message):
        TransformersModel.check_options(options)
    with pytest.raises(ConfigError, match=message):
        TransformersModel(model_id=str(base_dir), **options)


def test_full_fine_tuning_of_a_quantised_base_is_refused(base_dir):
    model = TransformersModel(model_id=str(base_dir), load_in_4bit=True)
    with pytest.raises(ConfigError, match=r"base is quantised.*add a LoRA adapter \(model.adapter"):
        model.set_optimizer("AdamW", lr=1e-3)


def test_a_model_built_from_a_config_alone_is_refused():
    with pytest.raises(ConfigError, match=r"model.config alone has none to load: save the model first"):
        TransformersModel(config=tiny_qwen2_config(), quantization=4)


def test_quantization_config_in_model_kwargs_as_well_is_refused(base_dir):
    kwargs = {"quantization_config": quantization.QuantizationSettings(bits=4).bnb_config()}
    with pytest.raises(ConfigError, match=r"model_kwargs.quantization_config both quantise"):
        TransformersModel(model_id=str(base_dir), quantization=4, model_kwargs=kwargs)
    with pytest.raises(ConfigError, match=r"model_kwargs.quantization_config both quantise"):
        TransformersModel.check_options({"quantization": 4, "model_kwargs": kwargs})


@pytest.mark.parametrize(("name", "stage", "refused"), [
    ("native_fsdp", None, "'native_fsdp'"), ("accelerate", None, "'accelerate'"), ("megatron", None, "'megatron'"),
    ("deepspeed", 3, "DeepSpeed ZeRO-3"), ("deepspeed", 2, None), ("ddp", None, None), ("single", None, None),
    ("ulysses", None, None), ("grad_allreduce", None, None),
])
def test_strategies_that_shard_parameters_are_refused(name, stage, refused):
    strategy = types.SimpleNamespace(name=name, stage=stage)
    no_fp8 = types.SimpleNamespace(name="bf16")
    if refused is None:
        quantization.check_strategy(strategy, no_fp8)
        return
    with pytest.raises(ConfigError, match=f"cannot run under strategy {refused}: it shards parameters.*use one of "
                                          f"single, ddp"):
        quantization.check_strategy(strategy, no_fp8)


def test_fp8_precision_is_refused(base_dir):
    with pytest.raises(ConfigError, match=r"cannot run with precision fp8"):
        quantization.check_strategy(types.SimpleNamespace(name="single"), types.SimpleNamespace(name="fp8"))


def test_a_missing_bitsandbytes_names_the_install_command(base_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    with pytest.raises(ConfigError, match=r"needs bitsandbytes, which is not installed.*pip install bitsandbytes"):
        TransformersModel.check_options({"load_in_4bit": True})
    with pytest.raises(ConfigError, match=r"pip install bitsandbytes"):
        TransformersModel(model_id=str(base_dir), load_in_4bit=True)


def test_a_bitsandbytes_without_cpu_kernels_names_its_version_and_a_cuda_gpu(monkeypatch):
    monkeypatch.setattr(bnb, "__version__", "0.45.5")
    with pytest.raises(ConfigError, match=r"bitsandbytes 0.45.5 runs 4-bit layers on CUDA only.*use a CUDA GPU"):
        quantization.check_device("cpu", 4)
    quantization.check_device("cuda", 4)  # CUDA is bitsandbytes' own device: nothing to probe


def test_a_bitsandbytes_whose_cpu_kernel_fails_names_the_error_and_a_cuda_gpu(monkeypatch):
    def missing_kernel(self, x):
        raise NotImplementedError("no kernel for cpu")

    monkeypatch.setattr(bnb.nn.Linear8bitLt, "forward", missing_kernel)
    quantization.kernel_problem.cache_clear()
    try:
        with pytest.raises(ConfigError, match=rf"bitsandbytes {bnb.__version__} cannot run 8-bit layers on cpu "
                                              r"\(NotImplementedError: no kernel for cpu\): use a CUDA GPU"):
            quantization.check_device("cpu", 8)
    finally:
        quantization.kernel_problem.cache_clear()
    assert quantization.kernel_problem("cpu", 4) is None  # the real kernels run here


def test_dry_run_refuses_invalid_quantization_before_building(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TWINKLE_NO_PROGRESS": "1",
           "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-m", "twinkle_core.cli", "train", "examples/quickstart/recipe.yaml",
                           "--dry-run", f"train.output_dir={tmp_path}", "model.options.quantization={bits: 3}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "model.options.quantization.bits must be 4 or 8" in done.stderr, done.stderr[-2000:]


# ---------------------------------------------------------------------- twinkle export --quantize
@pytest.mark.parametrize("method", ["4bit", "8bit"])
def test_export_quantize_merges_then_quantises_a_directory_that_loads_and_generates(qlora, tmp_path, method):
    merged, quantised = tmp_path / "merged", tmp_path / "quantised"
    assert main(["export", str(qlora.path), "--merge-lora", "-o", str(merged)]) == 0
    assert main(["export", str(qlora.path), "--merge-lora", "--quantize", method, "-o", str(quantised)]) == 0
    config = json.loads((quantised / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "bitsandbytes" and config[f"load_in_{method}"] is True
    assert json.loads((quantised / "twinkle_export.json").read_text())["quantize"] == method

    loaded = transformers.AutoModelForCausalLM.from_pretrained(quantised).eval()  # nothing but the directory
    layer = loaded.model.layers[0].self_attn.q_proj
    assert isinstance(layer, bnb.nn.Linear4bit if method == "4bit" else bnb.nn.Linear8bitLt)
    # the same as the merged full-precision export quantised on load (bitsandbytes quantises deterministically)
    settings = quantization.settings_from_options(method)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        merged, dtype=torch.float32, **quantization.load_kwargs(settings, "cpu")).eval()
    batch = qlora.batch
    with torch.no_grad():
        got = loaded(input_ids=batch["input_ids"]).logits
        torch.testing.assert_close(got, reference(input_ids=batch["input_ids"]).logits, rtol=0, atol=0)
        out = loaded.generate(batch["input_ids"][:1, :4], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)


def test_export_quantize_of_an_unmerged_adapter_asks_for_merge_lora(qlora, tmp_path, capsys):
    assert main(["export", str(qlora.path), "--quantize", "4bit", "-o", str(tmp_path / "x")]) == 2
    assert "add --merge-lora" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("method", "library"), [("gptq", "gptqmodel"), ("awq", "autoawq")])
def test_export_gptq_and_awq_are_refused_without_cuda(qlora, tmp_path, capsys, monkeypatch, method, library):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["export", str(qlora.path), "--merge-lora", "--quantize", method, "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and library in err and "llm-compressor" in err and "bench/gpu_check_quantize.py" in err
    assert not (tmp_path / "x").exists()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # with a GPU: still done by their own library
    with pytest.raises(ConfigError, match=rf"not built into twinkle export: quantise the exported model with "
                                          rf"{library}"):
        quantization.check_export(method, full_model=True)


def test_the_gpu_check_script_smoke_run_works_on_cpu(tmp_path):
    """bench/gpu_check_quantize.py does not rot: its --smoke run trains QLoRA and writes the bitsandbytes exports on
    CPU, and records GPTQ / AWQ as not run (they need a CUDA GPU)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore", "TWINKLE_NO_PROGRESS": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check_quantize.py"), "--smoke", "--out-dir",
                           str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    runs = json.loads((tmp_path / "gpu_check_quantize.json").read_text())["runs"]
    assert runs["qlora"]["status"] == "ok" and runs["qlora"]["loss_falls"]
    assert runs["qlora"]["base_layer"] == "Linear4bit" and runs["lora_full_precision"]["base_layer"] == "Linear"
    assert runs["export_4bit"]["layer"] == "Linear4bit" and runs["export_8bit"]["layer"] == "Linear8bitLt"
    assert runs["export_4bit"]["generated_tokens"] == 8
    assert runs["gptq"]["status"] == runs["awq"]["status"] == "not run: needs a CUDA GPU"
