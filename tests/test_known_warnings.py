"""twinkle_core.known_warnings: each known third-party warning is hidden by its exact category, text and module,
nothing else is, TWINKLE_SHOW_WARNINGS / --show-warnings bring them back, and the filters match what torch really
prints (checked in a subprocess with a one-process gloo group)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from twinkle_core import cli
from twinkle_core.commands.train import train_job
from twinkle_core.known_warnings import KNOWN_WARNINGS, SHOW_VARIABLE, quiet_known_warnings
from twinkle_core.launch import TrainJob


def shown(message: str, category: type[Warning], module: str) -> bool:
    """Whether a warning ``message`` of ``category`` attributed to ``module`` gets through the filters now set."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit(message, category, f"/site-packages/{module.replace('.', '/')}.py", 83, module=module,
                               registry={})
    return bool(caught)


@pytest.fixture
def filters(monkeypatch):
    """The warning filters as they were, restored after the test; TWINKLE_SHOW_WARNINGS unset."""
    monkeypatch.delenv(SHOW_VARIABLE, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield


REAL = [  # the texts and modules as the libraries print them (10-step CPU runs of the examples)
    ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use `torch.distributed.all_gather_single` "
     "instead.", FutureWarning, "torch.distributed.c10d_logger"),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use `torch.distributed.reduce_scatter_single` "
     "instead.", FutureWarning, "torch.distributed.c10d_logger"),
    ("`is_gradient_checkpointing` is deprecated and will be removed in v6. Use `is_activation_checkpointing` "
     "instead.", FutureWarning, "transformers.modeling_utils"),
    ("`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.",
     FutureWarning, "megatron.core.dist_checkpointing.strategies.torch"),
    ("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
     "torch.distributed.checkpoint.planner_helpers"),
    ("Please use DTensor instead and we are deprecating ShardedTensor.", FutureWarning,
     "torch.distributed.checkpoint.default_planner"),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.models.gpt.gpt_layer_specs"),
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning,
     "megatron.core.optimizer"),
    ("Transformer Engine and Apex are not installed. Falling back to local implementations of multi_tensor_applier "
     "and multi_tensor_scale", UserWarning, "megatron.core.distributed.fsdp.src.megatron_fsdp.mixed_precision"),
]


@pytest.mark.parametrize(("message", "category", "module"), REAL, ids=lambda v: str(v)[:30])
def test_each_known_warning_is_hidden(filters, message, category, module):
    assert shown(message, category, module)
    assert quiet_known_warnings() is True
    assert not shown(message, category, module)


@pytest.mark.parametrize(("message", "category", "module"), [
    # the same text from Twinkle's own code, or of another category, or another text from the same module
    (REAL[0][0], FutureWarning, "twinkle_core.distributed"),
    (REAL[0][0], UserWarning, "torch.distributed.c10d_logger"),
    ("`torch.distributed.broadcast` is deprecated.", FutureWarning, "torch.distributed.c10d_logger"),
    ("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatronic"),
    ("When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS "
     "to 1 for maximum speedup", UserWarning, "megatron.core.tensor_parallel.layers"),
    ("something else", DeprecationWarning, "torch.nn.modules.module"),
    ("`load_state_dict` is deprecated and will be removed in future versions.", FutureWarning, "twinkle_core.model"),
])
def test_nothing_else_is_hidden(filters, message, category, module):
    quiet_known_warnings()
    assert shown(message, category, module)


def test_no_blanket_filter():
    for known in KNOWN_WARNINGS:
        assert known.message.strip() and len(known.message) > 20, known
        assert known.module and known.category is not Warning, known
        assert known.why, known


def test_show_warnings_brings_them_back(filters, monkeypatch):
    monkeypatch.setenv(SHOW_VARIABLE, "1")
    assert quiet_known_warnings() is False
    assert shown(*REAL[0])
    monkeypatch.delenv(SHOW_VARIABLE)
    assert quiet_known_warnings(show=True) is False  # --show-warnings: also for the processes this one starts
    assert os.environ[SHOW_VARIABLE] == "1"
    assert shown(*REAL[0])


def test_installing_twice_keeps_one_copy(filters):
    quiet_known_warnings()
    count = len(warnings.filters)
    quiet_known_warnings()
    assert len(warnings.filters) == count


def test_show_warnings_reaches_every_rank():
    args = cli.build_parser().parse_args(["train", "r.yaml", "--nproc-per-node", "2", "--show-warnings"])
    assert train_job(args).worker_argv()[-1] == "--show-warnings"
    assert "--show-warnings" not in TrainJob("r.yaml").worker_argv()


SCRIPT = textwrap.dedent("""
    import os, sys, tempfile
    import torch, torch.distributed as dist
    if sys.argv[1] == "quiet":
        from twinkle_core.known_warnings import quiet_known_warnings
        quiet_known_warnings()
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    for _ in range(3):
        dist.all_gather_into_tensor(torch.zeros(2), torch.ones(2))
        dist.reduce_scatter_tensor(torch.zeros(2), torch.ones(2))
    dist.destroy_process_group()
""")


def test_the_filters_match_what_torch_prints(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != SHOW_VARIABLE}
    results = {mode: subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=env,
                                    timeout=120) for mode in ("loud", "quiet")}
    for result in results.values():
        assert result.returncode == 0, result.stderr
    assert "FutureWarning: `torch.distributed.all_gather_into_tensor` is deprecated" in results["loud"].stderr
    assert "FutureWarning: `torch.distributed.reduce_scatter_tensor` is deprecated" in results["loud"].stderr
    assert "Warning" not in results["quiet"].stderr, results["quiet"].stderr
