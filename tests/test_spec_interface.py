"""The spec's interface, as the spec writes it (/work/shared/spec/000_*.txt, "模型加载" and "并行策略").

* its model-loading snippet runs literally: ``from twinkle.model import TransformersModel`` and the three
  ``TransformersModel(model_id=...)`` calls (``ms://``, ``hf://``, a local path); only ``/path/to/model`` is
  replaced (by a tiny model on disk), and the two hubs are stand-ins serving that model offline;
* its parallel-strategy keys (``strategy=accelerate``, ``strategy=native_fsdp``, ``tp_size``, ``pp_size``,
  ``dp_size``, ``sequence_parallel``, ``ep_size``) work in the Python API and in recipes / on the command
  line, and mean exactly the mesh's sizes (``tp``, ``pp``, ``dp``, ``sp``, ``ep``);
* its default strategy (Accelerate-managed FSDP) is the default of every job with more than one process, one
  process runs without a wrapper (``single``): :func:`twinkle_core.mesh.default_strategy`.

The 2-process run with the default strategy is in twinkle-backend-hf/tests/test_default_strategy.py.
"""

from __future__ import annotations

import sys
import types

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.mesh import SPEC_KEYS, DeviceMesh, default_strategy
from twinkle_core.train.recipe import recipe_from_dict, strategy_name, validate_components

# ---------------------------------------------------------------------- the spec's text, literally
#: "## 模型加载" of the spec
SPEC_MODEL_LOADING = """
from twinkle.model import TransformersModel

# 从 ModelScope 加载（ms:// 前缀）
model = TransformersModel(model_id='ms://Qwen/Qwen3.5-4B')

# 从 HuggingFace 加载（hf:// 前缀）
model = TransformersModel(model_id='hf://meta-llama/Llama-3.3-70B-Instruct')

# 本地路径
model = TransformersModel(model_id='/path/to/model')
"""

#: "## 并行策略" of the spec: (strategy, configuration key, description)
SPEC_PARALLEL_TABLE = """
| FSDP | `strategy=accelerate` | Accelerate 管理的 FSDP（默认）|
| 原生 FSDP | `strategy=native_fsdp` | PyTorch 原生 FSDP |
| 张量并行 | `tp_size` | 跨 GPU 切分层 |
| 流水线并行 | `pp_size` | 切分模型阶段 |
| 数据并行 | `dp_size` | 复制模型，切分数据 |
| 序列并行 | `sequence_parallel` | 切分长序列 |
| 专家并行 | `ep_size` | MoE 专家分布 |
"""
ROWS = [[cell.strip() for cell in line.strip("|").split("|")] for line in SPEC_PARALLEL_TABLE.strip().splitlines()]
STRATEGIES = [row[1].strip("`").split("=")[1] for row in ROWS if row[1].startswith("`strategy=")]
SIZE_KEYS = [row[1].strip("`") for row in ROWS if not row[1].startswith("`strategy=")]
#: what each key means in mesh terms
MEANING = {"tp_size": "tp", "pp_size": "pp", "dp_size": "dp", "sequence_parallel": "sp", "ep_size": "ep"}
DEFAULT = next(row[1].strip("`").split("=")[1] for row in ROWS if "默认" in row[2])  # "(default)"


def test_the_table_is_what_this_file_tests():
    assert STRATEGIES == ["accelerate", "native_fsdp"] and DEFAULT == "accelerate"
    assert SIZE_KEYS == list(MEANING)
    assert all(SPEC_KEYS[key] == dim for key, dim in MEANING.items())


# ---------------------------------------------------------------------- fixtures
TINY = {"model_type": "qwen2", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
        "tie_word_embeddings": False}


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    # a sharding strategy built in this process starts a one-process group; later tests in the same pytest
    # process (a data loader reading RANK / WORLD_SIZE) must not see it
    import torch.distributed as dist

    started = dist.is_available() and dist.is_initialized()
    yield
    if not started and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def local_model(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("twinkle_backend_hf")
    directory = tmp_path_factory.mktemp("model")
    config = transformers.AutoConfig.for_model(**TINY)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture
def stand_in_hubs(local_model, monkeypatch):
    """ModelScope and the Hugging Face Hub, offline, serving the tiny model under the spec's ids."""
    served = {"Qwen/Qwen3.5-4B": local_model, "meta-llama/Llama-3.3-70B-Instruct": local_model}
    asked: list[str] = []

    def snapshot_download(model_id, revision=None, local_files_only=False, **kwargs):
        assert local_files_only, "offline: the cache only"
        asked.append(model_id)
        return str(served[model_id])

    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    modelscope = types.ModuleType("modelscope")
    modelscope.snapshot_download = snapshot_download
    modelscope.__version__ = "1.99.0"
    monkeypatch.setitem(sys.modules, "modelscope", modelscope)
    return asked


def _one_step(model) -> float:
    import torch

    model.set_optimizer("AdamW", lr=1e-3)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    out = model.forward_backward(inputs={"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
    model.clip_grad_and_step(max_grad_norm=1.0)
    return float(out["loss"])


# ---------------------------------------------------------------------- model loading, as written
def test_the_model_loading_snippet_runs_as_written(local_model, stand_in_hubs):
    namespace: dict = {}
    exec(SPEC_MODEL_LOADING.replace("/path/to/model", str(local_model)), namespace)  # noqa: S102
    assert stand_in_hubs == ["Qwen/Qwen3.5-4B", "meta-llama/Llama-3.3-70B-Instruct"]
    model = namespace["model"]
    assert type(model).__name__ == "TransformersModel"
    assert model.strategy.name == "single"  # one process: no wrapper (the spec's default is for > 1 process)
    assert _one_step(model) > 0


# ---------------------------------------------------------------------- strategy=accelerate / native_fsdp
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_key_as_written_on_the_command_line_and_in_a_recipe(strategy):
    base = {"model": {"config": TINY, "tokenizer": "tok"}, "data": {"train": "train.jsonl"}}
    assert recipe_from_dict(base, [f"strategy={strategy}"]).strategy.name == strategy  # `strategy=accelerate`
    assert recipe_from_dict({**base, "strategy": strategy}).strategy.name == strategy  # strategy: accelerate
    assert recipe_from_dict(base, [f"strategy.name={strategy}"]).strategy.name == strategy


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_strategy_key_in_the_python_api(strategy):
    pytest.importorskip("twinkle_backend_hf")
    from twinkle.model import TransformersModel

    # one process cannot shard; the strategy is the spec's (looked up, checked) and fails only on the mesh
    with pytest.raises(ConfigError, match=f"strategy {strategy!r} implements only the mesh dimension"):
        TransformersModel(config=TINY, strategy=strategy, tp_size=2)


# ---------------------------------------------------------------------- the size keys
@pytest.mark.parametrize("key", SIZE_KEYS)
def test_a_size_key_in_a_recipe_is_the_mesh_key(key):
    dim = MEANING[key]
    extra = {"dp": 2} if dim == "ep" else {}  # experts are spread over data-parallel ranks: ep must divide dp
    base = {"model": {"config": TINY, "tokenizer": "tok"}, "data": {"train": "train.jsonl"}, "strategy": "megatron"}
    more = [f"mesh.{d}={n}" for d, n in extra.items()]
    by_spec = recipe_from_dict(base, [f"{key}=2", *more])  # on the command line: twinkle train r.yaml tp_size=2
    by_mesh = recipe_from_dict(base, [f"mesh.{dim}=2", *more])
    assert by_spec.mesh == by_mesh.mesh == {**extra, dim: 2}
    assert recipe_from_dict({**base, key: 2, "mesh": extra}).mesh == {**extra, dim: 2}  # top level of a recipe
    assert recipe_from_dict({**base, "mesh": {key: 2, **extra}}).mesh == {**extra, dim: 2}  # or inside mesh
    assert recipe_from_dict({**base, key: 2, "mesh": {dim: 2, **extra}}).mesh == {**extra, dim: 2}  # both, agreeing
    with pytest.raises(ConfigError, match=rf"{key}=2 contradicts mesh.{dim}=4: they are the same setting"):
        recipe_from_dict({**base, key: 2, "mesh": {dim: 4}})
    with pytest.raises(ConfigError, match=rf"{key} must be a positive integer"):
        recipe_from_dict(base, [f"{key}=0"])


def test_all_spec_keys_together_and_the_other_dimensions():
    base = {"model": {"config": TINY, "tokenizer": "tok"}, "data": {"train": "train.jsonl"}}
    recipe = recipe_from_dict(base, ["tp_size=2", "pp_size=2", "dp_size=2", "ep_size=2", "sequence_parallel=1",
                                     "cp_size=1", "vpp_size=2"])
    assert recipe.mesh == {"tp": 2, "pp": 2, "dp": 2, "ep": 2, "sp": 1, "cp": 1, "vpp": 2}
    assert DeviceMesh.infer(8, tp_size=2, pp_size=2) == DeviceMesh.infer(8, tp=2, pp=2) == DeviceMesh(dp=2, tp=2, pp=2)


def test_misspelt_keys_keep_their_did_you_mean():
    base = {"model": {"config": TINY, "tokenizer": "tok"}, "data": {"train": "train.jsonl"}}
    with pytest.raises(ConfigError, match=r"tp_sise: unknown key; did you mean tp_size\?"):
        recipe_from_dict(base, ["tp_sise=2"])
    with pytest.raises(ConfigError, match=r"mesh.tp_sise: unknown mesh dimension; did you mean mesh.tp_size\?"):
        recipe_from_dict(base, ["mesh.tp_sise=2"])
    with pytest.raises(ConfigError, match=r"mesh.tpp: unknown mesh dimension; did you mean mesh.tp\?"):
        recipe_from_dict(base, ["mesh.tpp=2"])
    with pytest.raises(ConfigError, match=r"model.options.tp_size: is a mesh size; write tp_size at the top level"):
        recipe_from_dict(base, ["model.options.tp_size=2"])
    with pytest.raises(ConfigError, match=r"sequence_parallel: true is not a size"):
        recipe_from_dict(base, ["sequence_parallel=true"])
    with pytest.raises(ConfigError, match=r"sp_size=2 and sequence_parallel=4 set the same mesh dimension \(sp\)"):
        recipe_from_dict(base, ["sp_size=2", "sequence_parallel=4"])


def _error(call) -> str:
    with pytest.raises(ConfigError) as info:
        call()
    return str(info.value)


@pytest.mark.parametrize("key", SIZE_KEYS)
def test_a_size_key_in_the_python_api_is_the_mesh_key(key, local_model):
    from twinkle.model import TransformersModel

    dim = MEANING[key]
    model = TransformersModel(model_id=str(local_model), **{key: 1})
    assert model.strategy.mesh == DeviceMesh()
    # one process cannot run a size of 2: the spec key and the mesh key fail identically (the same setting)
    by_spec = _error(lambda: TransformersModel(model_id=str(local_model), strategy="native_fsdp", **{key: 2}))
    by_mesh = _error(lambda: TransformersModel(model_id=str(local_model), strategy="native_fsdp", mesh={dim: 2}))
    assert by_spec == by_mesh and f"{dim}=2" in by_spec
    assert f"{key}=2 contradicts mesh.{dim}=4" in _error(
        lambda: TransformersModel(model_id=str(local_model), mesh={dim: 4}, **{key: 2}))


def test_python_api_misspelt_key_and_boolean_sequence_parallel(local_model):
    from twinkle.model import TransformersModel

    assert "tp_sise (did you mean tp_size?)" in _error(lambda: TransformersModel(model_id=str(local_model), tp_sise=2))
    assert "sequence_parallel=2 is mesh sp=2" in _error(
        lambda: TransformersModel(model_id=str(local_model), sequence_parallel=True))


def test_megatron_model_takes_the_spec_keys_too():
    pytest.importorskip("twinkle_backend_megatron")
    from twinkle.model import MegatronModel

    # one process: the mesh is refused against the world size, naming the mesh the keys made
    by_spec = _error(lambda: MegatronModel(config=TINY, tp_size=2, pp_size=1))
    by_mesh = _error(lambda: MegatronModel(config=TINY, mesh={"tp": 2, "pp": 1}))
    assert by_spec == by_mesh and "tp=2" in by_spec


# ---------------------------------------------------------------------- the default strategy
def test_the_default_strategy_rule(monkeypatch):
    pytest.importorskip("twinkle_backend_hf")  # a backend answers for jobs of several processes
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert default_strategy() == "single"
    assert default_strategy(world_size=1) == "single"
    assert default_strategy(world_size=2) == DEFAULT == "accelerate"
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert default_strategy() == "accelerate"

    class OnlyMegatron:
        supported_strategies = ("megatron",)

    assert default_strategy(OnlyMegatron, world_size=1) == default_strategy(OnlyMegatron, world_size=8) == "megatron"


def test_a_recipe_without_a_strategy_gets_the_default_for_its_world_size(tmp_path):
    pytest.importorskip("twinkle_backend_hf")
    from twinkle.model import TransformersModel
    from twinkle_core.plugins import get_plugins

    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a b c"}\n')
    recipe = recipe_from_dict({"model": {"config": TINY, "tokenizer": str(tmp_path)}, "data": {"train": str(data)}})
    assert recipe.strategy.name is None
    assert strategy_name(recipe, TransformersModel, world_size=1) == "single"
    assert strategy_name(recipe, TransformersModel, world_size=2) == "accelerate"
    megatron = "MegatronModel" in get_plugins().names("model")
    if megatron:
        assert strategy_name(recipe, get_plugins().load("model", "MegatronModel"), world_size=2) == "megatron"
    # twinkle train --nproc-per-node 2 validates against the default it will run: accelerate implements dp / fsdp
    validate_components(recipe_from_dict({"model": {"config": TINY, "tokenizer": str(tmp_path)},
                                          "data": {"train": str(data)}, "dp_size": 2}), world_size=2)
    with pytest.raises(ConfigError, match="strategy 'accelerate' implements only the mesh dimension"):
        validate_components(recipe_from_dict({"model": {"config": TINY, "tokenizer": str(tmp_path)},
                                              "data": {"train": str(data)}, "tp_size": 2}), world_size=2)


def test_a_recipe_mesh_without_dp_gives_dp_the_remaining_ranks():
    assert DeviceMesh.for_job({"tp": 2}, 4) == DeviceMesh(tp=2, dp=2)  # the Megatron README's "dp (the rest)"
    assert DeviceMesh.for_job({"tp": 2, "dp": 1}, 2) == DeviceMesh(tp=2)
    with pytest.raises(ConfigError, match="not divisible"):
        DeviceMesh.for_job({"tp": 2}, 3)
    with pytest.raises(ConfigError, match="world size 4"):
        DeviceMesh.for_job({"tp": 2, "dp": 1}, 4)  # an explicit dp is kept, and checked
