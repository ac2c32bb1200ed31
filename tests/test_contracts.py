"""The one index of the behaviour seams (twinkle_core.contracts) lists every seam the classes declare.

The classes are read live: a public member added to ``Task``, ``Strategy`` or the backend extension section of
``TorchTwinkleModel`` without a row in ``SEAMS`` fails here, naming it.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

from twinkle_core.contracts import PHASES, SEAMS, Seam, render_markdown, seams_of
from twinkle_core.strategy import Strategy
from twinkle_core.task import Task

#: the backend extension the issue names; the section of torch_model.py may add more (read below)
BACKEND_EXTENSION = ("build_network", "run_network", "attach_adapter", "detach_adapter", "activate_adapter",
                     "deactivate_adapters", "local_weights", "adapter_parameter_names", "write_weights",
                     "read_weights", "describe", "output_layer")
SECTION_MARKER = re.compile(r"^    # =+ (.*)$")


def public_members(cls: type) -> set[str]:
    """What the class itself declares: methods, properties and class attributes not starting with ``_``."""
    return {name for name in vars(cls) if not name.startswith("_")}


def backend_extension_section() -> set[str]:
    """The public ``def``s of TorchTwinkleModel's section whose marker names the backend."""
    torch_model = pytest.importorskip("twinkle_core.model.torch_model")
    names, inside = set(), False
    for line in inspect.getsource(torch_model.TorchTwinkleModel).splitlines():
        marker = SECTION_MARKER.match(line)
        if marker:
            inside = "backend" in marker.group(1)
            continue
        found = re.match(r"^    def ([a-z]\w*)\(", line)
        if inside and found:
            names.add(found.group(1))
    return names


def missing(owner: str, members: set[str]) -> list[str]:
    return sorted(members - set(seams_of(owner)))


def test_every_task_member_is_listed():
    assert not missing("Task", public_members(Task)), "Task members without a row in twinkle_core.contracts.SEAMS"


def test_every_strategy_member_is_listed():
    assert not missing("Strategy", public_members(Strategy)), (
        "Strategy members without a row in twinkle_core.contracts.SEAMS")


def test_every_backend_extension_method_is_listed():
    section = backend_extension_section()
    assert set(BACKEND_EXTENSION) <= section, f"not in the backend extension section: " \
                                              f"{sorted(set(BACKEND_EXTENSION) - section)}"
    assert not missing("TorchTwinkleModel", section), (
        "TorchTwinkleModel backend methods without a row in twinkle_core.contracts.SEAMS")


def test_rows_name_real_members_once_in_a_known_phase():
    torch_model = pytest.importorskip("twinkle_core.model.torch_model")
    from twinkle_core.loss.base import Loss
    from twinkle_core.metrics import Metric
    from twinkle_core.model.base import TwinkleModel
    from twinkle_core.model.multi_tenant import MultiTenantMixin
    from twinkle_core.model.train_state import TrainState
    from twinkle_core.rewards import Reward
    from twinkle_core.sampling import Sampler

    classes = {cls.__name__: cls for cls in (Task, Strategy, torch_model.TorchTwinkleModel, TwinkleModel, Loss,
                                             Metric, TrainState, Sampler, Reward, MultiTenantMixin)}
    names = [seam.qualified_name for seam in SEAMS]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
    for seam in SEAMS:
        assert seam.phase in PHASES, seam
        assert all((seam.called_by, seam.when, seam.example)), seam
        assert hasattr(classes[seam.owner], seam.name), f"{seam.qualified_name} does not exist"


def test_the_coverage_check_can_fail():
    class WithNewSeam(Task):
        def choose_head(self, model):  # a seam nobody documented
            return None

    assert missing("Task", public_members(WithNewSeam)) == ["choose_head"]


def test_markdown_has_one_section_per_phase_and_one_row_per_seam():
    text = render_markdown()
    assert [line[5:] for line in text.splitlines() if line.startswith("#### ")] == \
        [p for p in PHASES if any(s.phase == p for s in SEAMS)]
    assert sum(line.startswith("| `") for line in text.splitlines()) == len(SEAMS)
    assert "| `Task.process_outputs` |" in text
    example = Seam("step", "Task", "x", "a | b", "now", "`y`")
    assert "a \\| b" in render_markdown((example,))  # a pipe inside a cell does not split the row


def test_module_prints_the_table():
    result = subprocess.run([sys.executable, "-m", "twinkle_core.contracts"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == render_markdown()
