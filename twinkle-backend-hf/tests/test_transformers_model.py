"""TransformersModel: HF-loadable checkpoints, packing, checkpointing, precision, sources, remote code."""

from __future__ import annotations

import copy
import json
import os
import textwrap

import pytest
import torch
import transformers
from twinkle_backend_hf.model import TransformersModel
from twinkle_backend_hf.testing import make_tiny_model, tiny_qwen2_config

from twinkle_core import checkpoint
from twinkle_core.errors import ConfigError, UnsupportedHardwareError
from twinkle_core.model import checkpoint_io
from twinkle_core.testing.conformance import LORA_CONFIG, make_batch


def test_lora_checkpoint_loads_with_plain_peft(tmp_path):
    import peft

    model = make_tiny_model(seed=0)
    model.add_adapter_to_model("default", copy.deepcopy(LORA_CONFIG))
    model.set_optimizer("AdamW", lr=1e-2)
    batch = make_batch(0)
    for _ in range(2):
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
    path = model.save("lora", output_dir=str(tmp_path))
    assert sorted(f for f in os.listdir(path) if f.startswith("adapter")) == [
        "adapter_config.json", "adapter_model.safetensors"]
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**tiny_qwen2_config()), dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, path).eval()
    with torch.no_grad():
        got = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    torch.testing.assert_close(got, model.forward_only(inputs=batch)["logits"], atol=1e-5, rtol=1e-5)


def test_local_path_source_round_trip(tmp_path):
    model = make_tiny_model(seed=3)
    batch = make_batch(1)
    path = model.save("base", output_dir=str(tmp_path), save_optimizer=False)
    again = TransformersModel(model_id=path)
    torch.testing.assert_close(again.forward_only(inputs=batch)["logits"], model.forward_only(inputs=batch)["logits"])
    with pytest.raises(Exception, match="does-not-exist"):
        TransformersModel(model_id=str(tmp_path / "does-not-exist"))


def test_needs_model_id_or_config():
    with pytest.raises(ConfigError, match="model_id= .* or config="):
        TransformersModel()


def _packed_and_separate():
    g = torch.Generator().manual_seed(0)
    lengths = (5, 7, 4)
    seqs = [torch.randint(3, 64, (n,), generator=g) for n in lengths]
    packed = {"input_ids": torch.cat(seqs)[None], "labels": torch.cat(seqs)[None].clone(),
              "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    start = 0
    for n in lengths:  # the first token of every packed sequence predicts nothing
        packed["labels"][0, start] = -100
        start += n
    separate = [{"input_ids": s[None], "labels": s[None].clone(), "attention_mask": torch.ones(1, len(s)).long()}
                for s in seqs]
    for item in separate:
        item["labels"][0, 0] = -100
    return lengths, packed, separate


def test_packed_batch_equals_separate_sequences():
    model = make_tiny_model(seed=0)
    lengths, packed, separate = _packed_and_separate()
    packed_logits = model.forward_only(inputs=packed)["logits"][0]
    start = 0
    for n, item in zip(lengths, separate):
        alone = model.forward_only(inputs=item)["logits"][0]
        torch.testing.assert_close(packed_logits[start:start + n], alone, atol=1e-5, rtol=1e-5)
        start += n
    # same per-sequence loss sum and token count, hence the same mean and gradients
    total = model.calculate_loss(inputs=packed, outputs={"logits": packed_logits[None]})
    parts = [model.calculate_loss(inputs=item, outputs=model.forward_only(inputs=item)) for item in separate]
    assert int(total.num_tokens) == sum(int(p.num_tokens) for p in parts)
    torch.testing.assert_close(total.loss, sum(p.loss for p in parts), atol=1e-5, rtol=1e-5)


def test_no_attention_across_packed_sequences():
    model = make_tiny_model(seed=0)
    _, packed, _ = _packed_and_separate()
    changed = {k: v.clone() for k, v in packed.items()}
    changed["input_ids"][0, :5] = (changed["input_ids"][0, :5] + 1) % 64  # edit only the first sequence
    a = model.forward_only(inputs=packed)["logits"][0, 5:]
    b = model.forward_only(inputs=changed)["logits"][0, 5:]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_gradient_checkpointing_gives_the_same_update():
    batch = make_batch(2)
    plain, checkpointed = make_tiny_model(seed=0), make_tiny_model(seed=0, gradient_checkpointing=True)
    norms = []
    for m in (plain, checkpointed):
        m.set_optimizer("SGD", lr=0.1)
        m.forward_backward(inputs=batch)
        norms.append(m.clip_grad_and_step(max_grad_norm=None))
    assert norms[0] == pytest.approx(norms[1], rel=1e-6)
    assert checkpointed.hf_model.is_gradient_checkpointing
    for k, v in plain.get_state_dict().items():
        torch.testing.assert_close(v, checkpointed.get_state_dict()[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precisions_train_on_cpu_with_default_settings(precision):
    reference, model = make_tiny_model(seed=0), make_tiny_model(seed=0, precision=precision)
    batch = make_batch(3)
    losses: dict[str, list[float]] = {"ref": [], "half": []}
    for key, m in (("ref", reference), ("half", model)):
        m.set_optimizer("AdamW", lr=1e-2)
        for _ in range(10):
            out = m.forward_backward(inputs=batch)
            assert m.clip_grad_and_step() > 0
            losses[key].append(float(out["loss"]))
    assert losses["half"][0] == pytest.approx(losses["ref"][0], rel=2e-2)
    assert losses["half"][-1] < losses["half"][0] * 0.8
    assert model.get_train_configs()["skipped_steps"] == 0  # the default loss scale does not overflow
    if precision == "fp16":
        assert model.precision.state_dict()["scaler"]["scale"] > 0


def test_fp8_without_a_hopper_gpu_is_a_clear_error():
    with pytest.raises(UnsupportedHardwareError, match="fp8.*compute capability >= 8.9.*bf16"):
        make_tiny_model(precision="fp8")


def test_a_crash_mid_save_leaves_no_complete_looking_checkpoint(tmp_path, monkeypatch):
    model = make_tiny_model(seed=0)
    model.set_optimizer("AdamW", lr=1e-3)

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_io, "save_training_state", explode)
    with pytest.raises(OSError, match="disk full"):
        model.save("checkpoint-5", output_dir=str(tmp_path))
    assert not (tmp_path / "checkpoint-5").exists()
    assert not any(checkpoint.is_complete(str(p)) for p in tmp_path.iterdir())


REMOTE_CONFIG = '''
from transformers import PretrainedConfig


class TinyRemoteConfig(PretrainedConfig):
    model_type = "tiny_remote"

    def __init__(self, vocab_size=64, hidden_size=16, **kwargs):
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        super().__init__(**kwargs)
'''
REMOTE_MODEL = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_remote import TinyRemoteConfig


class TinyRemoteForCausalLM(PreTrainedModel):
    config_class = TinyRemoteConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=None, **kwargs):
        return CausalLMOutput(logits=self.head(self.embed(input_ids)))
'''


def test_remote_code_loads_from_a_local_directory_only_when_trusted(tmp_path):
    """InternLM 2.5 ships its modelling code in the checkpoint; this is the same mechanism on a local dir."""
    (tmp_path / "configuration_tiny_remote.py").write_text(textwrap.dedent(REMOTE_CONFIG))
    (tmp_path / "modeling_tiny_remote.py").write_text(textwrap.dedent(REMOTE_MODEL))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "tiny_remote", "vocab_size": 64, "hidden_size": 16,
        "auto_map": {"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig",
                     "AutoModelForCausalLM": "modeling_tiny_remote.TinyRemoteForCausalLM"}}))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path), trust_remote_code=True)
    transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=True).save_pretrained(str(tmp_path))
    with pytest.raises(Exception, match="trust_remote_code"):
        TransformersModel(model_id=str(tmp_path))
    os.environ["TWINKLE_TRUST_REMOTE_CODE"] = "0"
    try:
        with pytest.raises(Exception, match="trust_remote_code"):
            TransformersModel(model_id=str(tmp_path))
    finally:
        del os.environ["TWINKLE_TRUST_REMOTE_CODE"]
    model = TransformersModel(model_id=str(tmp_path), trust_remote_code=True)
    model.set_optimizer("AdamW", lr=1e-2)
    out = model.forward_backward(inputs=make_batch(0))
    assert torch.isfinite(out["loss"])


def test_saving_warns_when_the_tokenizer_would_reload_differently(tmp_path, caplog):
    """A qwen2 checkpoint's tokenizer loads back as Qwen2Tokenizer; a non-byte-level one would change."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    raw.decoder = decoders.Fuse()
    raw.train_from_iterator(["Twinkle probe: 12 + 30 = 42. indented line and a tab \t\n"],
                            trainers.WordLevelTrainer(special_tokens=["<unk>"]))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    model = make_tiny_model(seed=0, tokenizer=tokenizer)
    with caplog.at_level("WARNING", logger="twinkle.hf"):
        model.save("ckpt", output_dir=str(tmp_path), save_optimizer=False)
    assert "tokenises differently" in caplog.text
