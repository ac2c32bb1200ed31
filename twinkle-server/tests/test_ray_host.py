"""A base model on a Ray worker group behind the one HTTP front: a real local Ray cluster (loopback, 2 CPUs), a real
``twinkle serve`` process hosting two base models on 2 ranks each (gloo, ``grad_allreduce``), driven by the
unmodified Tinker SDK and the native client.

Parity: 3 Tinker steps on 2 ranks (3, 1 and 3 datums of uneven lengths: uneven shares, and an idle rank) give the
losses, per-token log-probs and exported adapter of the single-process host, within the float noise of the
single-process host itself (the same run with its datums reversed: ``twinkle_core.testing.tolerance``).
"""

from __future__ import annotations

import importlib.util
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from twinkle_server.testing import TINY_BASE, ServerProcess, tiny_model_section, tiny_server_config

from twinkle_core.errors import ConfigError
from twinkle_core.testing.tolerance import assert_within_spread, forward_tolerance, sum_tolerance

if importlib.util.find_spec("ray") is None:  # not imported here: a local cluster binds to loopback only when the
    pytest.skip("ray is not installed", allow_module_level=True)  # first import of ray is twinkle_ray.cluster's
tinker = pytest.importorskip("tinker")
types = tinker.types

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

KEY = "tml-alice-ray-key-01"
SECOND = "twinkle/tiny-qwen2-b"
RANK, SEED, LR = 4, 5, 1e-2
# 3, 1 and 3 datums of uneven lengths: rank 0 gets 2 datums and rank 1 one, then rank 1 has none
LENGTHS = [[7, 12, 5], [9], [11, 6, 8]]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}


def steps_data() -> list[list[tuple[list[int], list[float]]]]:
    rng = np.random.default_rng(0)
    return [[(rng.integers(1, 262, n + 1).tolist(), rng.uniform(0.5, 1.5, n).round(3).tolist()) for n in lengths]
            for lengths in LENGTHS]


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster in this process (2 CPUs), shut down however the module ends; the server joins it."""
    from twinkle_ray.cluster import connected

    with connected(num_cpus=2) as ray:
        yield ray


@pytest.fixture(scope="module")
def server(cluster, tmp_path_factory):
    address = cluster.get_runtime_context().gcs_address
    # 2 ranks for the first model, 1 for the second (each its own group and placement group): 1.5 of 2 CPUs
    config = tiny_server_config(tmp_path_factory.mktemp("ray-host"), tenants={"alice": KEY}, base_models=[
        {"name": TINY_BASE, "model": tiny_model_section(), "max_lora_rank": 32,
         "ray": {"workers": 2, "cpus_per_worker": 0.5, "address": address}},
        {"name": SECOND, "model": tiny_model_section(seed=1), "max_lora_rank": 32,
         "ray": {"workers": 1, "cpus_per_worker": 0.5, "address": address}}])
    with ServerProcess(config, start_timeout_s=240) as process:  # SIGTERM (then SIGKILL) however the module ends
        yield process


@pytest.fixture(scope="module")
def alice(server):
    client = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield client
    if server.process.poll() is None:  # the last test closes it and stops the server itself
        client.close("success").result(timeout=60)


def reference_run(steps, tmp_path: Path, *, reverse: bool = False):
    """The 3 steps on the single-process host (``reverse``: each step's datums in reverse order, outputs put back)."""
    from twinkle_server.host import AdamStep, Datum, ModelHost

    host = ModelHost(TINY_BASE, tiny_model_section(), state_dir=tmp_path, max_lora_rank=32)
    host.create_adapter("ref", rank=RANK, seed=SEED)
    losses, logprobs, norms = [], [], []
    for step in steps:
        data = [Datum(tokens=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": w}) for t, w in step]
        order = list(reversed(range(len(data)))) if reverse else list(range(len(data)))
        result = host.forward_backward("ref", [data[i] for i in order], "cross_entropy")
        rows = dict(zip(order, result.per_datum))
        losses.append(result.metrics["loss:sum"])
        logprobs.append([rows[i]["logprobs"] for i in range(len(data))])
        norms.append(host.optim_step("ref", AdamStep(learning_rate=LR))["grad_norm"])
    host.export_adapter("ref", tmp_path / "export")
    return host, losses, logprobs, norms, _adapter(tmp_path / "export")


def _adapter(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


def _flat(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([weights[k].flatten() for k in sorted(weights)])


# ------------------------------------------------------------------------------------------------ tests
def test_two_ranks_train_as_one_process_and_sample(server, alice, tmp_path):
    steps = steps_data()
    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=RANK, seed=SEED).result()
    losses, logprobs, norms = [], [], []
    for step in steps:
        batch = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                             loss_fn_inputs={"target_tokens": t[1:], "weights": w}) for t, w in step]
        out = client.forward_backward(batch, "cross_entropy").result()
        norms.append(client.optim_step(types.AdamParams(learning_rate=LR)).result().metrics["grad_norm"])
        losses.append(out.metrics["loss:sum"])
        logprobs.append([o["logprobs"].tolist() for o in out.loss_fn_outputs])
    saved = client.save_weights_for_sampler("final").result().path
    exported = next(Path(server.config.parent, "state", "tenants", "alice").glob("*/*/final"))

    host, ref_losses, ref_logprobs, ref_norms, ref_adapter = reference_run(steps, tmp_path / "ref")
    rev_host, rev_losses, rev_logprobs, rev_norms, rev_adapter = reference_run(steps, tmp_path / "rev", reverse=True)
    tokens = sum(len(t) - 1 for step in steps for t, _ in step)
    delta = assert_within_spread("loss:sum per step", losses, ref_losses, rev_losses,
                                 floor=sum_tolerance(tokens, max(map(abs, ref_losses))))
    # the gradient of the whole request's sum, not an average over the ranks (Adam alone would not tell: it is
    # invariant to the gradient's scale)
    norm_delta = assert_within_spread("grad_norm per step", norms, ref_norms, rev_norms,
                                      floor=sum_tolerance(tokens, max(ref_norms)))
    flat = [x for step in logprobs for row in step for x in row]
    ref_flat = [x for step in ref_logprobs for row in step for x in row]
    rev_flat = [x for step in rev_logprobs for row in step for x in row]
    lp_delta = assert_within_spread("per-token logprobs", flat, ref_flat, rev_flat,
                                    floor=forward_tolerance(max(map(abs, ref_flat)), width=64, depth=2))
    got = _adapter(exported)
    assert got.keys() == ref_adapter.keys()
    w_delta = assert_within_spread("exported adapter", _flat(got), _flat(ref_adapter), _flat(rev_adapter),
                                   floor=sum_tolerance(tokens, float(_flat(ref_adapter).abs().max())))
    print(f"2 ranks vs one process: |loss| {delta:.3g}, |grad norm| {norm_delta:.3g}, |logprob| {lp_delta:.3g}, "
          f"|adapter| {w_delta:.3g}")

    # sampling (rank 0) from the saved weights: the prompt's logprobs are the reference hosts'
    sampler = alice.create_sampling_client(model_path=saved).result()
    prompt = steps[0][0][0]
    params = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    sampled = sampler.sample(types.ModelInput.from_ints(prompt), 2, params, include_prompt_logprobs=True).result()
    assert [len(s.tokens) for s in sampled.sequences] == [4, 4]
    want = []
    for reference, directory in ((host, tmp_path / "ref" / "export"), (rev_host, tmp_path / "rev" / "export")):
        reference.load_sampler("s", directory)
        want.append(reference.compute_logprobs("s", prompt))
    assert sampled.prompt_logprobs[0] is None and want[0][0] is None
    assert_within_spread("prompt logprobs", sampled.prompt_logprobs[1:], want[0][1:], want[1][1:],
                         floor=forward_tolerance(max(abs(x) for x in want[0][1:]), width=64, depth=2))


def test_save_state_and_load_state_round_trip(server, alice):
    steps = steps_data()
    client = alice.create_lora_training_client(base_model=TINY_BASE, rank=RANK, seed=SEED).result()

    def train(step_data) -> float:
        batch = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                             loss_fn_inputs={"target_tokens": t[1:], "weights": w}) for t, w in step_data]
        out = client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=LR)).result()
        return out.metrics["loss:sum"]

    train(steps[0])
    saved = client.save_state("after-1").result().path
    continued = [train(steps[1]), train(steps[2])]
    with warnings.catch_warnings():  # load_state* are deprecated in the SDK, still sent as load_weights
        warnings.simplefilter("ignore", FutureWarning)
        client.load_state_with_optimizer(saved).result()
    assert [train(steps[1]), train(steps[2])] == continued  # the same ranks, the same arithmetic: exact


def test_native_client_trains_a_ray_hosted_adapter(server):
    from twinkle_backend_hf.multi_lora import MultiLoraTransformersModel
    from twinkle_server.client import TransformersModel
    from twinkle_server.errors import BadRequest

    from twinkle_core.constants import IGNORE_INDEX

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 262, (4, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 7:] = mask[3, 4:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.where(mask.bool(), ids, IGNORE_INDEX)}
    local = MultiLoraTransformersModel(config=tiny_model_section()["config"], seed=0, precision="no",
                                       strategy="single", max_lora_rank=32)
    torch.manual_seed(3)
    local.add_adapter_to_model("n", dict(LORA))
    remote = TransformersModel(model_id=TINY_BASE, base_url=server.base_url, api_key=KEY)
    remote.add_adapter_to_model("n", dict(LORA), seed=3)
    for m, kwargs in ((remote, {}), (local, {"adapter_name": "n"})):
        m.set_loss("cross_entropy", **kwargs)
        m.set_optimizer("AdamW", lr=LR, **kwargs)
    got, want = remote.forward_backward(inputs=batch), local.forward_backward(inputs=batch, adapter_name="n")
    print(f"native: loss {float(got['loss'])!r} vs {float(want['loss'])!r}")
    assert abs(float(got["loss"]) - float(want["loss"])) <= forward_tolerance(float(want["loss"]), width=64, depth=2)
    assert int(got["num_tokens"]) == int(want["num_tokens"]) == int(mask.sum()) - len(ids)  # shifted labels
    norms = remote.clip_grad_and_step(max_grad_norm=1.0), local.clip_grad_and_step(max_grad_norm=1.0, adapter_name="n")
    print(f"native: grad norm {norms[0]!r} vs {norms[1]!r}")
    assert abs(norms[0] - norms[1]) <= forward_tolerance(norms[1], width=64, depth=2)
    assert remote.get_train_configs()["step"] == 1
    with pytest.raises(BadRequest, match="does not split evenly over 2 data-parallel ranks"):
        remote.forward_backward(inputs={k: v[:3] for k, v in batch.items()})
    assert remote.get_train_configs()["step"] == 1  # the refusal left the group up and the adapter as it was
    # native sampling runs on rank 0 with the adapter's current weights: greedy tokens as the local model's
    greedy = remote.sample([[1, 2, 3]], max_new_tokens=4, temperature=0.0, seed=0)
    local_greedy = local_generate(local, "n", [[1, 2, 3]], max_new_tokens=4)
    assert [list(c.token_ids) for c in greedy[0]] == local_greedy
    remote.close()


def test_a_second_base_model_trains_on_its_own_worker_group(server, alice):
    client = alice.create_lora_training_client(base_model=SECOND, rank=RANK, seed=SEED).result()
    (tokens, weights), = steps_data()[1]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights})
    first = client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    client.optim_step(types.AdamParams(learning_rate=0.1)).result()
    assert client.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"] < first
    log = Path(server.log).read_text()
    for name, workers in ((TINY_BASE, 2), (SECOND, 1)):
        assert f"base model {name} group: {workers} workers" in log, log[-3000:]


def wait_until_freed(cluster, groups: set[str], cpus: float, what: str) -> None:
    """Until the placement groups ``groups`` are removed and ``cpus`` CPUs are free again (their actors gone)."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + 30
    while True:
        table = placement_group_table()
        states = {g: table[g]["state"] for g in groups}
        free = cluster.available_resources().get("CPU", 0.0)
        if all(s == "REMOVED" for s in states.values()) and free == cpus:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: placement groups {states}, {free} of {cpus} CPUs free")
        time.sleep(0.5)


def test_a_failed_start_stops_the_groups_already_started(server, cluster, tmp_path):
    from ray.util import placement_group_table
    from twinkle_server.app import default_host_factory
    from twinkle_server.config import server_config

    before, free = set(placement_group_table()), cluster.available_resources()["CPU"]
    on_ray = {"workers": 1, "cpus_per_worker": 0.25, "address": cluster.get_runtime_context().gcs_address}
    config = server_config({"state_dir": str(tmp_path), "tenants": [{"name": "a", "api_key": KEY}], "base_models": [
        {"name": "good", "model": tiny_model_section(), "ray": on_ray},
        {"name": "bad", "model": {**tiny_model_section(), "colour": "blue"}, "ray": on_ray}]})
    with pytest.raises(Exception, match=r"base model bad rank 0 failed: ConfigError: model section: unknown key\(s\) "
                                        r"\['colour'\]"):
        default_host_factory(config)
    created = set(placement_group_table()) - before
    assert len(created) == 2, created
    wait_until_freed(cluster, created, free, "after a failed start")


def test_stopping_the_server_frees_every_actor_and_placement_group(server, cluster, alice):
    from ray.util import placement_group_table

    alice.close("success").result(timeout=60)  # its session ends while the server is up (no heartbeat left behind)
    groups = set(placement_group_table())
    assert server.stop() in (0, -signal.SIGTERM)  # uvicorn ends with the signal it handled, after its shutdown
    assert "Application shutdown complete." in Path(server.log).read_text()
    wait_until_freed(cluster, groups, cluster.cluster_resources()["CPU"], "after the server stopped")


# ------------------------------------------------------------------------------------------------ no cluster
def test_ray_section_is_checked_before_anything_starts(tmp_path):
    from twinkle_server.config import server_config

    def config(*ray_sections):
        return server_config({"state_dir": str(tmp_path), "tenants": [{"name": "a", "api_key": KEY}],
                              "base_models": [{"name": f"m{i}", "model": tiny_model_section(), "ray": r}
                                              for i, r in enumerate(ray_sections)]})

    assert config({"workers": 2}).base_models[0].ray.workers == 2
    assert config({}).base_models[0].ray.placement == "PACK"
    with pytest.raises(ConfigError, match=r"ray: unknown key\(s\) \['worker'\]; known: \['address', "):
        config({"worker": 2})
    with pytest.raises(ConfigError, match="workers must be a positive integer"):
        config({"workers": 0})
    with pytest.raises(ConfigError, match="placement 'tight' is not one of PACK, SPREAD"):
        config({"placement": "tight"})
    with pytest.raises(ConfigError, match="give every ray section the same address"):
        config({"address": "10.0.0.1:6379"}, {"address": None})


def test_shares_and_metrics_merge_as_one_process():
    from twinkle_server.ray_host import contiguous_shares, merge_metrics

    assert contiguous_shares(3, 2) == [(0, 2), (2, 3)]
    assert contiguous_shares(1, 3) == [(0, 1), (1, 1), (1, 1)]
    merged = merge_metrics([{"loss:sum": 1.5, "a:mean": 2.0, "b:max": 1.0}, {"loss:sum": 2.0, "a:mean": 5.0,
                                                                            "b:max": 3.0}], [2, 1])
    assert merged == {"loss:sum": 3.5, "a:mean": 3.0, "b:max": 3.0}
    with pytest.raises(RuntimeError, match="no rule merges its reduction 'unique'"):
        merge_metrics([{"x:unique": 1.0}], [1])


def local_generate(model, adapter_name, prompts, *, max_new_tokens):
    """Greedy completions of the in-process model, by the same core sampler the server uses."""
    from twinkle_server.native_generate import generate

    from twinkle_core.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    groups = generate(model, None, adapter_name, prompts, 1, params, [[0]] * len(prompts))
    return [c["token_ids"] for c in groups[0]]
