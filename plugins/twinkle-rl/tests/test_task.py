"""The ``preference`` task: tokenisation, truncation, batch layout, and reference log-probs."""

from __future__ import annotations

import copy
import inspect
import logging

import pytest
import torch
from twinkle_rl.layout import PREFERENCE_PAIRS, pairs, sequence_sums
from twinkle_rl.pairs import PreferenceFeature
from twinkle_rl.reference import reference_logps
from twinkle_rl.task import PreferenceTask

from twinkle_core.data.loader import DataLoader
from twinkle_core.errors import ConfigError, DataFormatError
from twinkle_core.loss.logprobs import token_logprobs

USER = [{"role": "user", "content": "reverse: kdoq"}]
GOOD = {"messages": USER, "chosen": "qodk", "rejected": "kdoq"}
EOT = "<|im_end|>"


def labelled_text(tokenizer, ids, labels):
    return tokenizer.decode([i for i, label in zip(ids, labels, strict=True) if label != -100])


def load(tokenizer, rows, **options):
    task = PreferenceTask()
    return task, task.load_dataset(rows, tokenizer, **options)


def pair_rows(n):
    return [{"prompt": f"reverse: {'abcdefgh'[:i + 2]}", "chosen": "abcdefgh"[:i + 2][::-1],
             "rejected": "abcdefgh"[:i + 2]} for i in range(n)]


# ---------------------------------------------------------------------- tokenisation
def test_task_declares_what_the_losses_need():
    from twinkle_core.plugins import get_plugins

    assert get_plugins().load("task", "preference") is PreferenceTask
    assert PreferenceTask.default_loss == "dpo" and PREFERENCE_PAIRS in PreferenceTask.provides


def test_prompt_tokenised_once_and_only_answer_tokens_labelled(tokenizer):
    _, (feature,) = load(tokenizer, [GOOD])
    prompt_text = tokenizer.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert feature.prompt_ids == tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    chosen, rejected = feature.sequences()
    assert labelled_text(tokenizer, chosen.input_ids, chosen.labels) == "qodk" + EOT
    assert labelled_text(tokenizer, rejected.input_ids, rejected.labels) == "kdoq" + EOT
    for sequence in (chosen, rejected):
        assert sequence.input_ids[:len(feature.prompt_ids)] == feature.prompt_ids
        assert set(sequence.labels[:len(feature.prompt_ids)]) == {-100}
        # the whole sequence is what the chat template renders for the finished conversation
        assert tokenizer.decode(sequence.input_ids) == tokenizer.apply_chat_template(
            USER + [{"role": "assistant", "content": "qodk" if sequence is chosen else "kdoq"}], tokenize=False)


def test_message_list_answer_trains_assistant_turns_only(tokenizer):
    answer = [{"role": "assistant", "content": "calc"}, {"role": "tool", "content": "42"},
              {"role": "assistant", "content": "it is 42"}]
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, *USER]
    _, (feature,) = load(tokenizer, [{"messages": history, "chosen": answer, "rejected": "no"}])
    chosen, rejected = feature.sequences()
    # neither the earlier assistant turn of the prompt nor the tool result is trained
    assert labelled_text(tokenizer, chosen.input_ids, chosen.labels) == f"calc{EOT}it is 42{EOT}"
    assert labelled_text(tokenizer, rejected.input_ids, rejected.labels) == "no" + EOT


def test_prompt_string_with_system(tokenizer):
    _, (feature,) = load(tokenizer, [{"prompt": "reverse: ab", "system": "be brief", "chosen": "ba",
                                      "rejected": "ab"}])
    assert tokenizer.decode(feature.prompt_ids) == tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "reverse: ab"}],
        tokenize=False, add_generation_prompt=True)


def test_tokenizer_without_chat_template_is_a_clear_error(tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ConfigError, match="chat template"):
        PreferenceTask().load_dataset([GOOD], plain)


def test_data_options_are_checked(tokenizer):
    from twinkle_core.options import check_options

    with pytest.raises(ConfigError, match="mode: chat"):
        PreferenceTask().load_dataset([GOOD], tokenizer, mode="pretrain")
    with pytest.raises(ConfigError, match="over_length"):
        PreferenceTask(over_length="cut")
    with pytest.raises(ConfigError, match="reference"):
        PreferenceTask(reference="base")
    check_options(PreferenceTask().load_dataset, {"over_length": "skip"}, where="data.options", positional=2)
    with pytest.raises(ConfigError, match="over_lenght"):
        check_options(PreferenceTask, {"over_lenght": "skip"}, where="task_options")


# ---------------------------------------------------------------------- truncation
def _full(tokenizer, row):
    return load(tokenizer, [row])[1][0]


def test_long_prompt_is_cut_from_its_start_identically_for_both(tokenizer, caplog):
    row = {"prompt": "reverse: " + "abc" * 20, "chosen": "xyz", "rejected": "uvwxyz"}
    full = _full(tokenizer, row)
    limit = full.longest - 10
    with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
        task, (cut, _) = load(tokenizer, [row, GOOD], max_length=limit)
    assert cut.prompt_ids == full.prompt_ids[10:]  # the end of the prompt (the turn being answered) stays
    assert (cut.chosen_ids, cut.rejected_ids) == (full.chosen_ids, full.rejected_ids)
    assert all(len(s) <= limit for s in cut.sequences())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "1 of 2 pairs are longer than max_length" in warnings[0]
    assert "1 truncated" in warnings[0] and "0 skipped" in warnings[0]
    assert task.stats == {"pairs": 2, "truncated": 1, "skipped_over_length": 0, "skipped_identical": 0}


def test_long_answers_are_cut_to_the_same_length(tokenizer):
    row = {"prompt": "hi", "chosen": "q" * 60, "rejected": "r" * 50}
    full = _full(tokenizer, row)
    limit = 40
    assert len(full.prompt_ids) < limit // 2
    (cut,) = load(tokenizer, [row], max_length=limit)[1]
    keep = limit - len(full.prompt_ids)
    assert cut.prompt_ids == full.prompt_ids
    assert cut.chosen_ids == full.chosen_ids[:keep] and cut.rejected_ids == full.rejected_ids[:keep]
    assert cut.chosen_labels == full.chosen_labels[:keep] and cut.rejected_labels == full.rejected_labels[:keep]
    assert [len(s) for s in cut.sequences()] == [limit, limit]


def test_long_prompt_and_answers_keep_half_the_length_for_the_prompt(tokenizer):
    row = {"prompt": "p" * 80, "chosen": "q" * 60, "rejected": "r" * 70}
    full = _full(tokenizer, row)
    (cut,) = load(tokenizer, [row], max_length=32)[1]
    assert cut.prompt_ids == full.prompt_ids[-16:]
    assert cut.chosen_ids == full.chosen_ids[:16] and cut.rejected_ids == full.rejected_ids[:16]
    for sequence in cut.sequences():
        assert len(sequence) == 32 and sum(label != -100 for label in sequence.labels) == 16


def test_skip_drops_long_pairs_and_counts_them(tokenizer, caplog):
    long_row = {"prompt": "reverse: " + "abc" * 20, "chosen": "x", "rejected": "y"}
    limit = _full(tokenizer, GOOD).longest
    with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
        task, features = load(tokenizer, [GOOD, long_row, long_row], max_length=limit, over_length="skip")
    assert len(features) == 1 and task.stats["skipped_over_length"] == 2
    assert any("2 skipped" in r.getMessage() for r in caplog.records)
    with pytest.raises(DataFormatError, match="over_length=skip drops them all"):
        PreferenceTask(over_length="skip").load_dataset([long_row], tokenizer, max_length=limit)


def test_pairs_that_become_identical_when_truncated_are_skipped_and_counted(tokenizer, caplog):
    """Answers that differ only beyond max_length are the same tokens once cut: such a pair teaches nothing
    (its DPO margin is 0 whatever the model), so it is skipped and counted like a pair of identical answers."""
    same_start = {"prompt": "hi", "chosen": "q" * 40 + "right", "rejected": "q" * 40 + "wrong"}
    identical = {"prompt": "hi", "chosen": "same", "rejected": "same"}
    limit = len(_full(tokenizer, {"prompt": "hi", "chosen": "q", "rejected": "r"}).prompt_ids) + 20
    with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
        task, features = load(tokenizer, [GOOD, same_start, identical], max_length=limit)
    assert len(features) == 1 and features[0].chosen_ids != features[0].rejected_ids
    assert task.stats == {"pairs": 1, "truncated": 1, "skipped_over_length": 0, "skipped_identical": 2}
    assert "same tokens after max_length" in caplog.text
    with pytest.raises(DataFormatError, match="every pair's answers are the same tokens"):
        PreferenceTask().load_dataset([same_start], tokenizer, max_length=limit)
    untruncated = load(tokenizer, [same_start])[1]  # without the cut the pair is kept
    assert len(untruncated) == 1


@pytest.mark.parametrize("options, match", [
    ({"max_length": float("nan")}, "max_length must be an integer >= 2"),
    ({"pad_to_multiple_of": 0}, "pad_to_multiple_of must be an integer >= 1"),
])
def test_non_finite_or_out_of_range_task_options_are_refused(options, match):
    with pytest.raises(ConfigError, match=match):
        PreferenceTask(**options)


# ---------------------------------------------------------------------- batches
def test_padded_layout(tokenizer):
    task, features = load(tokenizer, pair_rows(3))
    batch = task.collate(features)
    assert batch["input_ids"].shape[0] == 6 and "position_ids" not in batch and "sequence_index" not in batch
    assert batch["pair_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch["is_chosen"].tolist() == [True, False] * 3
    sequences = [s for f in features for s in f.sequences()]
    pad = tokenizer.pad_token_id
    for row, sequence in enumerate(sequences):
        n = len(sequence)
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        assert batch["input_ids"][row, :n].tolist() == sequence.input_ids
        assert set(batch["input_ids"][row, n:].tolist()) <= {pad}
        assert batch["labels"][row, :n].tolist() == sequence.labels and set(batch["labels"][row, n:].tolist()) <= {-100}
    assert pairs(batch, "test").chosen.tolist() == [0, 2, 4]


def test_packed_layout(tokenizer):
    task = PreferenceTask(pad_to_multiple_of=64)
    features = task.load_dataset(pair_rows(2), tokenizer, packing=True)
    batch = task.collate(features)
    lengths = [len(s) for f in features for s in f.sequences()]
    width = -(-sum(lengths) // 64) * 64
    assert width > sum(lengths)  # there is padding to check
    assert "attention_mask" not in batch and batch["input_ids"].shape == (1, width)
    expected_index, expected_positions = [], []
    for index, n in enumerate(lengths):
        expected_index += [index] * n
        expected_positions += list(range(n))
    total = sum(lengths)
    assert batch["sequence_index"][0].tolist() == expected_index + [-1] * (width - total)
    assert batch["position_ids"][0, :total].tolist() == expected_positions
    assert batch["labels"][0, total:].eq(-100).all()
    assert batch["pair_index"].tolist() == [0, 0, 1, 1] and batch["is_chosen"].tolist() == [True, False, True, False]


def test_precomputed_ref_logps_pass_through(tokenizer):
    task, features = load(tokenizer, pair_rows(2))
    cached = [PreferenceFeature(**{**f.__dict__, "ref_logps": (-1.0 - i, -2.0 - i)}) for i, f in enumerate(features)]
    assert task.collate(cached)["ref_logps"].tolist() == [-1.0, -2.0, -2.0, -3.0]
    with pytest.raises(ValueError, match="for every pair or for none"):
        task.collate([cached[0], features[1]])
    assert "ref_logps" not in task.collate(features)


def test_packed_and_padded_give_the_same_sequence_logps(tokenizer):
    from twinkle_backend_hf.testing import make_tiny_model, tiny_qwen2_config

    model = make_tiny_model(config=tiny_qwen2_config(vocab_size=262))
    padded_task, features = load(tokenizer, pair_rows(3))
    packed_task = PreferenceTask(packing=True)
    packed_task.load_dataset(pair_rows(3), tokenizer)
    results = []
    for task in (padded_task, packed_task):
        batch = task.collate(features)
        logits = model.forward_only(inputs=batch)["logits"].float()
        logps, mask = token_logprobs(logits, batch["labels"])
        sums, counts = sequence_sums(logps, mask, batch, 6)
        results.append((sums, counts))
    (padded, padded_counts), (packed, packed_counts) = results
    assert padded_counts.tolist() == packed_counts.tolist()
    torch.testing.assert_close(packed, padded, rtol=1e-4, atol=1e-4)


def test_data_parallel_split_never_splits_a_pair(tokenizer):
    task, features = load(tokenizer, pair_rows(6))
    prompt_of = {tuple(f.prompt_ids): f for f in features}
    seen = []
    for rank in range(2):
        loader = DataLoader(features, 2, task.collate, shuffle=True, seed=3, dp_rank=rank, dp_size=2)
        for batch in loader:
            layout = pairs(batch, "test")
            for c, r in zip(layout.chosen.tolist(), layout.rejected.tolist(), strict=True):
                ids_c, ids_r = batch["input_ids"][c].tolist(), batch["input_ids"][r].tolist()
                feature = next(f for p, f in prompt_of.items() if ids_c[:len(p)] == list(p))
                chosen, rejected = feature.sequences()
                assert ids_c[:len(chosen)] == chosen.input_ids and ids_r[:len(rejected)] == rejected.input_ids
                seen.append(feature.line)
    assert sorted(seen) == [f.line for f in features]


# ---------------------------------------------------------------------- reference log-probs
class FakeModel:
    """Logits looked up from a random table by input id: enough to tell which network ran."""

    def __init__(self, *, adapters=(), loss=None, step=0, seed=0):
        self.table = torch.randn(262, 262, generator=torch.Generator().manual_seed(seed))
        self.adapters, self.loss, self.step = list(adapters), loss, step
        self.calls, self.copies = [], []

    def get_train_configs(self, *, adapter_name=None):
        return {"adapters": self.adapters, "loss": self.loss, "step": self.step}

    def forward_only(self, *, inputs, adapter_name=None, disable_adapters=False):
        self.calls.append({"adapter_name": adapter_name, "disable_adapters": disable_adapters})
        table = self.table * 0.5 if disable_adapters else self.table  # "the adapter" changes the logits
        return {"logits": table[inputs["input_ids"]]}

    def frozen_copy(self):
        frozen = FakeModel()
        frozen.table = self.table.clone()
        self.copies.append(frozen)
        return frozen


def expected_ref(table, batch):
    """Per-sequence sums written out token by token (padded batches)."""
    out = []
    for row in range(batch["input_ids"].shape[0]):
        logp = torch.log_softmax(table[batch["input_ids"][row]].double(), -1)
        total = sum(logp[t - 1, batch["input_ids"][row, t]] for t in range(1, batch["input_ids"].shape[1])
                    if batch["labels"][row, t] != -100)
        out.append(float(total))
    return torch.tensor(out)


@pytest.fixture
def pair_batch(tokenizer):
    task, features = load(tokenizer, pair_rows(2))
    return task.collate(features)


def test_adapter_reference_runs_the_base_model(pair_batch):
    model, task = FakeModel(adapters=["default"]), PreferenceTask(reference="adapter")
    task.prepare_model(model)
    batch = task.prepare_batch(model, pair_batch)
    assert model.calls == [{"adapter_name": "default", "disable_adapters": True}]
    assert batch["ref_logps"].dtype == torch.float32 and batch["ref_logps"].shape == (4,)
    torch.testing.assert_close(batch["ref_logps"], expected_ref(model.table * 0.5, pair_batch).float())
    assert "ref_logps" not in pair_batch  # the collated batch itself is left alone


def test_adapter_reference_without_adapter_is_an_error(pair_batch):
    with pytest.raises(ConfigError, match="needs a model with a LoRA adapter"):
        PreferenceTask(reference="adapter").prepare_batch(FakeModel(), pair_batch)


def test_model_reference_keeps_the_weights_of_prepare_model(pair_batch):
    model, task = FakeModel(), PreferenceTask(reference="model")
    task.prepare_model(model)
    initial = model.table.clone()
    model.table += 1.0  # training (or a resumed checkpoint) changes the policy afterwards
    batch = task.prepare_batch(model, pair_batch)
    assert len(model.copies) == 1 and model.calls == [] and len(model.copies[0].calls) == 1
    torch.testing.assert_close(batch["ref_logps"], expected_ref(initial, pair_batch).float())
    task.prepare_batch(model, pair_batch)
    assert len(model.copies) == 1  # one copy for the whole run


def test_model_reference_needs_prepare_model(pair_batch):
    with pytest.raises(ConfigError, match="prepare_model"):
        PreferenceTask(reference="model").prepare_batch(FakeModel(), pair_batch)


def test_none_reference_adds_nothing(pair_batch):
    model = FakeModel()
    task = PreferenceTask(reference="none")
    task.prepare_model(model)
    assert task.prepare_batch(model, pair_batch) is pair_batch and model.calls == [] and model.copies == []


def test_precomputed_ref_logps_are_kept(pair_batch):
    model, cached = FakeModel(adapters=["default"]), {**pair_batch, "ref_logps": torch.zeros(4)}
    assert PreferenceTask().prepare_batch(model, cached) is cached and model.calls == []


@pytest.mark.parametrize(("model", "provider"), [
    (FakeModel(adapters=["default"], loss={"name": "dpo"}), "adapter"),
    (FakeModel(loss={"name": "simpo"}), "none"),
    (FakeModel(loss={"name": "orpo"}), "none"),
    (FakeModel(loss={"name": "dpo", "reference_free": True}), "none"),
    (FakeModel(loss={"name": "dpo"}), "model"),
    (FakeModel(), "model"),
])
def test_auto_reference(pair_batch, model, provider):
    task = PreferenceTask()
    task.prepare_model(model)  # the trainer adds the adapter and sets the loss only after this
    assert task.provider is None or provider == "adapter"
    batch = task.prepare_batch(model, pair_batch)
    assert task.provider.name == provider
    assert ("ref_logps" in batch) == (provider != "none")
    assert len(model.copies) == (provider == "model")


def test_auto_reference_decided_in_prepare_model_when_the_adapter_exists(pair_batch):
    model, task = FakeModel(adapters=["default"]), PreferenceTask()
    task.prepare_model(model)
    assert task.provider.name == "adapter"


def test_auto_reference_refuses_a_late_frozen_copy_of_a_resumed_run(pair_batch):
    with pytest.raises(ConfigError, match="reference: model"):
        PreferenceTask().prepare_batch(FakeModel(step=5), pair_batch)


# ---------------------------------------------------------------------- with a real (tiny) model
def _tiny():
    from twinkle_backend_hf.testing import make_tiny_model, tiny_qwen2_config

    return make_tiny_model(config=tiny_qwen2_config(vocab_size=262))


def test_adapter_reference_through_the_hf_backend(pair_batch):
    model = _tiny()
    if "disable_adapters" not in inspect.signature(model.forward_only).parameters:
        pytest.skip("this backend's forward_only has no disable_adapters yet")
    model.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    with torch.no_grad():  # LoRA starts as the identity; make the adapter matter
        for name, parameter in model.module.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    task = PreferenceTask()
    task.prepare_model(model)
    batch = task.prepare_batch(model, pair_batch)
    base = reference_logps(_tiny().forward_only(inputs=pair_batch)["logits"], pair_batch)
    policy = reference_logps(model.forward_only(inputs=pair_batch)["logits"], pair_batch)
    assert task.provider.name == "adapter"
    torch.testing.assert_close(batch["ref_logps"], base, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(policy, base, atol=1e-3)


def test_model_reference_through_the_hf_backend(pair_batch):
    model = _tiny()
    if not hasattr(model, "frozen_copy"):
        pytest.skip("this backend has no frozen_copy yet")
    task = PreferenceTask(reference="model")
    task.prepare_model(model)
    with torch.no_grad():
        for parameter in model.module.parameters():
            parameter.add_(0.05)
    batch = task.prepare_batch(model, pair_batch)
    initial = reference_logps(_tiny().forward_only(inputs=pair_batch)["logits"], pair_batch)
    torch.testing.assert_close(batch["ref_logps"], initial, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_starts_at_log2_and_packing_changes_nothing(tokenizer, lora):
    """Before any step the policy is its own reference, so DPO's first loss is exactly log 2 (this checks that
    the reference log-probs line up with the policy's, sequence by sequence); packed batches train the same."""
    import math

    losses = {}
    for packing in (False, True):
        task = PreferenceTask(packing=packing)
        features = task.load_dataset(pair_rows(4), tokenizer)
        model = _tiny()
        task.prepare_model(model)
        name = None
        if lora:
            name = "default"
            model.add_adapter_to_model(name, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
        model.set_loss("dpo", adapter_name=name)
        model.set_optimizer("AdamW", adapter_name=name, lr=1e-2)
        losses[packing] = []
        for _ in range(2):
            batch = task.prepare_batch(model, task.collate(features))
            losses[packing].append(float(model.forward_backward(inputs=batch, adapter_name=name)["loss"]))
            model.clip_grad_and_step(adapter_name=name)
        assert task.provider.name == ("adapter" if lora else "model")
    assert losses[False][0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses[False][1] < losses[False][0]
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)


def test_precomputed_reference_never_falls_back_to_computing_per_batch(pair_batch, tmp_path):
    model, task = FakeModel(adapters=["default"]), PreferenceTask(reference="precomputed")
    task.prepare_model(model)  # a script that adds its adapter first
    with pytest.raises(ConfigError, match="prepare_dataset"):
        task.prepare_batch(model, pair_batch)
    assert model.calls == []


def test_precomputed_reference_is_cached_and_reused(tokenizer, tmp_path):
    task = PreferenceTask(reference="precomputed")
    features = task.load_dataset(pair_rows(3), tokenizer)
    model = FakeModel(adapters=["default"])
    annotated = task.prepare_dataset(model, features, split="train", output_dir=str(tmp_path))
    assert len(model.calls) == 1 and model.calls[0]["disable_adapters"]  # one pass, with the base model
    expected = expected_ref(model.table * 0.5, task.collate(features))
    assert [v for f in annotated for v in f.ref_logps] == pytest.approx(expected.tolist(), rel=1e-6)
    again = task.prepare_dataset(model, features, split="train", output_dir=str(tmp_path))
    # reused after one forward pass over the probe pairs (here all three) that checks the reference
    assert len(model.calls) == 2 and [f.ref_logps for f in again] == [f.ref_logps for f in annotated]
    changed = task.prepare_dataset(model, features[:2], split="train", output_dir=str(tmp_path))
    assert len(model.calls) == 3 and len(changed) == 2  # other data: computed again (no probe: nothing to check)
    batch = task.collate(annotated)
    assert task.prepare_batch(model, batch) is batch and len(model.calls) == 3


def test_precomputed_reference_of_other_start_weights_is_computed_again(tokenizer, tmp_path, caplog):
    """The cache is keyed by the data, and checked against the reference itself: the same data with other
    start weights (a retrained SFT model under the same path) must not reuse the old model's log-probs."""
    from twinkle_rl.precompute import PROBE_PAIRS, probe_indices

    task = PreferenceTask(reference="precomputed")
    features = task.load_dataset(pair_rows(6) * 4, tokenizer)  # 24 pairs: the probe samples 16 of them
    assert probe_indices(24) == sorted(set(probe_indices(24))) and len(probe_indices(24)) == PROBE_PAIRS
    assert probe_indices(24)[0] == 0 and probe_indices(24)[-1] == 23
    old = FakeModel(adapters=["default"], seed=0)
    task.prepare_dataset(old, features, split="train", output_dir=str(tmp_path))
    new = FakeModel(adapters=["default"], seed=1)  # other weights, same data and output directory
    with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
        annotated = task.prepare_dataset(new, features, split="train", output_dir=str(tmp_path))
    assert len(new.calls) == 1 + 2  # the probe, then the whole pass (24 pairs: two batches of 16)
    assert "computed with another reference model" in caplog.text
    expected = expected_ref(new.table * 0.5, task.collate(features))
    assert [v for f in annotated for v in f.ref_logps] == pytest.approx(expected.tolist(), rel=1e-6)
    again = FakeModel(adapters=["default"], seed=1)
    task.prepare_dataset(again, features, split="train", output_dir=str(tmp_path))
    assert len(again.calls) == 1  # the new values were cached: the probe agrees, nothing is computed


def test_a_cache_of_the_previous_version_is_computed_again(tokenizer, tmp_path, caplog):
    from twinkle_rl.precompute import cache_path, fingerprint

    task = PreferenceTask(reference="precomputed")
    features = task.load_dataset(pair_rows(2), tokenizer)
    path = cache_path(str(tmp_path), "train")
    (tmp_path / "reference_logps").mkdir()
    torch.save({"fingerprint": fingerprint(features), "ref_logps": torch.zeros(2, 2)}, path)  # no version: stale
    model = FakeModel(adapters=["default"])
    with caplog.at_level(logging.WARNING, logger="twinkle.rl"):
        annotated = task.prepare_dataset(model, features, split="train", output_dir=str(tmp_path))
    assert "another version" in caplog.text and annotated[0].ref_logps != (0.0, 0.0)


def test_evaluate_counts_generations_that_give_the_chosen_or_the_rejected_answer(tokenizer, monkeypatch):
    import twinkle_core.tasks.causal_lm as causal_lm

    task = PreferenceTask()
    features = task.load_dataset(pair_rows(3), tokenizer)
    answers = [features[0].chosen_ids, features[1].rejected_ids, tokenizer.encode("something else")]
    seen = []

    def fake_generate(model, prompts, **options):
        seen.append([list(p) for p in prompts])
        return [list(a) for a in answers[:len(prompts)]]

    monkeypatch.setattr(causal_lm, "greedy_generate", fake_generate)
    result = task.evaluate(object(), features, tokenizer, max_new_tokens=4)
    assert result == {"preferred_rate": pytest.approx(1 / 3), "rejected_rate": pytest.approx(1 / 3), "num_examples": 3}
    assert seen == [[f.prompt_ids for f in features]]  # the prompts end with the generation prompt


# ---------------------------------------------------------------------- through twinkle train
@pytest.mark.timeout(300)
def test_a_retrained_start_model_gets_a_fresh_precomputed_reference(tmp_path):
    """A new DPO run in the same output directory (``--overwrite`` keeps caches) from a retrained SFT model under
    the same path: its first step must compare the policy with itself (margin 0), not with the old model."""
    import json
    import shutil
    from pathlib import Path

    from twinkle_core.train.loop import train

    examples = Path(__file__).resolve().parents[3] / "examples"
    (tmp_path / "sft.jsonl").write_text("".join((examples / "dpo" / "sft.jsonl").read_text().splitlines(True)[:32]))
    (tmp_path / "pairs.jsonl").write_text("".join((examples / "dpo" / "train.jsonl").read_text().splitlines(True)[:24]))
    config = {"model_type": "qwen2", "vocab_size": 262, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0,
              "pad_token_id": 0}

    def sft(steps):
        out = tmp_path / f"sft{steps}"
        train({"task": "causal_lm", "precision": "no",
               "model": {"class_name": "TransformersModel", "tokenizer": str(examples / "quickstart" / "tokenizer"),
                         "config": config},
               "data": {"train": str(tmp_path / "sft.jsonl"), "mode": "chat", "max_length": 64, "batch_size": 16},
               "optimizer": {"name": "AdamW", "lr": 3e-3}, "lr_scheduler": {"name": "constant"},
               "train": {"output_dir": str(out), "max_steps": steps, "seed": 0}})
        start = tmp_path / "start"  # the path the DPO recipe names, rewritten by the second SFT run
        shutil.rmtree(start, ignore_errors=True)
        shutil.copytree(out / "final", start)
        return start

    def dpo(start, **kw):
        out = tmp_path / "dpo"
        train({"task": "preference", "task_options": {"reference": "precomputed"}, "precision": "no",
               "model": {"class_name": "TransformersModel", "model_id": str(start)},
               "data": {"train": str(tmp_path / "pairs.jsonl"), "max_length": 64, "batch_size": 8},
               "loss": {"name": "dpo", "options": {"beta": 0.1}}, "optimizer": {"name": "AdamW", "lr": 1e-3},
               "lr_scheduler": {"name": "constant"},
               "train": {"output_dir": str(out), "max_steps": 1, "seed": 0, "log_every": 1}}, **kw)
        lines = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
        return [line for line in lines if line["event"] == "train"][-1]

    assert dpo(sft(1))["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    cache = tmp_path / "dpo" / "reference_logps" / "train.pt"
    before = torch.load(cache)["ref_logps"]
    line = dpo(sft(3), overwrite=True)  # same data, same output directory, same model path: other weights
    assert line["rewards/margins"] == pytest.approx(0.0, abs=1e-6), line  # the old model's cached values: not 0
    assert line["rewards/accuracies"] == 0.0
    assert not torch.allclose(torch.load(cache)["ref_logps"], before, atol=1e-3)  # the cache was replaced
