"""Megatron on Ascend: MindSpeed's adaptor is imported before megatron-core, or a clear error says what to do.

No Ascend here and no MindSpeed: a fake ``mindspeed`` package on ``sys.path`` records when its adaptor runs, an
``npu`` accelerator stand-in (gloo underneath) drives the strategy. The end-to-end order test runs in a fresh
interpreter, because this one has imported megatron-core already (other tests) and must keep that copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from twinkle_backend_megatron import ascend

from twinkle_core.accelerator import Accelerator, CPUAccelerator
from twinkle_core.errors import UnsupportedHardwareError


class FakeNPUAccelerator(Accelerator):
    """The npu accelerator as twinkle-backend-npu's CPU fake of torch_npu makes it: named ``npu``, collectives
    over ``hccl`` (registered as gloo by the subprocess test), tensors on the CPU (so megatron-core gets Twinkle's
    CPU layer, standing in for what MindSpeed does on the device)."""

    name = "npu"
    device_type = "cpu"
    dist_backend = "hccl"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def device(self, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")


#: the fake adaptor notes which megatron-core modules were loaded when it ran
_ADAPTOR = """
import sys
sys.modules["twinkle_test_import_log"].events.append(
    ("adaptor", sorted(m for m in sys.modules if m == "megatron.core" or m.startswith("megatron.core."))))
{after}
"""


def _fake_mindspeed(root: Path, after: str = "") -> Path:
    package = root / "mindspeed"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "megatron_adaptor.py").write_text(_ADAPTOR.format(after=after))
    return root


@pytest.fixture
def isolated_imports(monkeypatch, tmp_path):
    """Hide megatron-core and mindspeed from this test and drop whatever it imports afterwards."""
    hidden = [m for m in sys.modules if m.split(".")[0] in ("megatron", "mindspeed")]
    for name in hidden:
        monkeypatch.delitem(sys.modules, name)
    log = types.ModuleType("twinkle_test_import_log")
    log.events = []
    monkeypatch.setitem(sys.modules, "twinkle_test_import_log", log)
    yield log
    for name in [m for m in sys.modules if m.split(".")[0] in ("megatron", "mindspeed")]:
        if name not in hidden:
            del sys.modules[name]  # monkeypatch restores the hidden originals


def test_cpu_and_other_accelerators_import_nothing(isolated_imports, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(_fake_mindspeed(tmp_path)))
    assert ascend.prepare_megatron(CPUAccelerator()) is False
    assert ascend.ADAPTOR not in sys.modules
    assert isolated_imports.events == []


def test_npu_imports_the_adaptor_before_megatron_core(isolated_imports, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(_fake_mindspeed(tmp_path)))
    assert ascend.prepare_megatron(FakeNPUAccelerator()) is True
    assert isolated_imports.events == [("adaptor", [])]
    # a second model in the same process: patched already, nothing runs twice
    assert ascend.prepare_megatron(FakeNPUAccelerator()) is True
    assert len(isolated_imports.events) == 1


def test_npu_without_mindspeed_names_the_install(isolated_imports, monkeypatch):
    monkeypatch.setitem(sys.modules, "mindspeed", None)  # absent even where someone installed it
    with pytest.raises(UnsupportedHardwareError) as caught:
        ascend.prepare_megatron(FakeNPUAccelerator())
    message = str(caught.value)
    assert "Megatron on Ascend NPU needs MindSpeed, which is not installed" in message
    assert "pip install -e MindSpeed" in message and ascend.VERSION_TABLE in message
    from importlib.metadata import version

    assert f"megatron-core version ({version('megatron-core')})" in message


def test_megatron_core_imported_first_is_refused(isolated_imports, monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(_fake_mindspeed(tmp_path)))
    monkeypatch.setitem(sys.modules, "megatron.core", types.ModuleType("megatron.core"))
    with pytest.raises(UnsupportedHardwareError, match=r"imported before MindSpeed could patch it \(megatron\.core "
                                                       r"already loaded\).*`import mindspeed\.megatron_adaptor` at "
                                                       r"the top of your script"):
        ascend.prepare_megatron(FakeNPUAccelerator())
    assert isolated_imports.events == []  # refused before the adaptor ran


def test_a_missing_dependency_of_mindspeed_is_not_reported_as_missing_mindspeed(isolated_imports, monkeypatch,
                                                                                tmp_path):
    monkeypatch.syspath_prepend(str(_fake_mindspeed(tmp_path, after="import twinkle_no_such_dependency")))
    with pytest.raises(ModuleNotFoundError, match="twinkle_no_such_dependency"):
        ascend.prepare_megatron(FakeNPUAccelerator())


_END_TO_END = """
import json, sys, types
import torch
log = types.ModuleType("twinkle_test_import_log"); log.events = []
sys.modules["twinkle_test_import_log"] = log
sys.path.insert(0, {tests!r})
from test_mindspeed import FakeNPUAccelerator
import torch.distributed as dist
# what the fake torch_npu does: hccl runs gloo on CPU tensors
dist.Backend.register_backend("hccl", lambda store, rank, size, timeout: dist.ProcessGroupGloo(store, rank, size,
                              timeout), devices=["cpu"])
from twinkle_backend_megatron.strategy import MegatronStrategy
assert not any(m.startswith("megatron") for m in sys.modules), "importing the strategy must not import megatron"
strategy = MegatronStrategy()
strategy.setup(FakeNPUAccelerator())
from megatron.core import parallel_state as ps
print("RESULT", json.dumps({{"events": log.events, "backend": dist.get_backend(),
                           "parallel_state": ps.model_parallel_is_initialized(), "cpu_layer": strategy.cpu_layer}}))
"""


def test_strategy_setup_on_npu_runs_the_adaptor_first(tmp_path):
    """The real strategy, fresh interpreter: the adaptor runs before any megatron-core import, then setup works."""
    root = _fake_mindspeed(tmp_path)
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)  # a one-rank group of its own, not the caller's job
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(_END_TO_END.format(tests=tests))], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["events"] == [["adaptor", []]]  # megatron-core was not loaded when the adaptor ran
    assert result["backend"] == "hccl"  # the accelerator's collective backend, nothing hard-coded
    assert result["parallel_state"] is True and result["cpu_layer"] is True
