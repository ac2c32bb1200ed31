"""The core's whole conformance suite against TransformersModel on the npu accelerator (fake torch_npu).

In one process through :class:`ModelContract` with the fake installed, and on 2 torchrun ranks with
the ``ddp`` strategy (``hccl``, which the fake runs as gloo) through ``run_on_fake_npu``. The factory
(``make_tiny_npu_model``) fails every test whose model is not on the npu accelerator or whose process
group is not HCCL, and the runs below also check the ``torch.npu`` calls the fake recorded.
"""

from __future__ import annotations

import json
import re

import pytest

from twinkle_core.testing.conformance import ModelContract, TaskContract
from twinkle_core.testing.torchrun import PASSED_ONLY, pytest_summaries, run_torchrun


class TestTransformersModelOnFakeNPU(ModelContract):
    @pytest.fixture
    def twinkle_factory(self, fake_npu):
        from twinkle_backend_npu.testing.conformance import make_tiny_npu_model

        def factory(**options):
            model = make_tiny_npu_model(**options)
            # the accelerator bound the process to an NPU through torch.npu, not the CPU accelerator
            assert fake_npu.called("set_device"), "torch.npu.set_device was never called"
            return model

        return factory


class TestTransformersModelTasksOnFakeNPU(TaskContract):
    twinkle_factory = TestTransformersModelOnFakeNPU.twinkle_factory


def test_the_factory_refuses_the_cpu_accelerator(monkeypatch):
    from twinkle_backend_npu.testing.conformance import make_tiny_npu_model

    monkeypatch.setenv("TWINKLE_ACCELERATOR", "cpu")
    with pytest.raises(AssertionError, match="runs on the 'cpu' accelerator, not 'npu'"):
        make_tiny_npu_model()


@pytest.mark.distributed
@pytest.mark.timeout(660)
def test_conformance_suite_with_ddp_on_two_fake_npu_ranks(tmp_path):
    result = run_torchrun(["-m", "twinkle_backend_npu.testing.run_on_fake_npu", "--pyargs",
                           "twinkle_core.testing.conformance", "--twinkle-backend", "hf-npu-ddp",
                           "-p", "no:cacheprovider", "-q"], nproc=2, timeout=600, cwd=str(tmp_path),
                          per_rank_output=True)
    assert result.returncode == 0, result.output
    summaries = pytest_summaries(result)
    assert all(PASSED_ONLY.fullmatch(line) for line in summaries), \
        f"expected every test to pass on each rank, got {summaries}\n{result.output}"
    for rank, text in enumerate(result.rank_stdout):
        line = re.search(r"^fake torch_npu: (.*)$", text, flags=re.MULTILINE)
        assert line, f"rank {rank} printed no fake torch_npu summary\n{result.output}"
        seen = json.loads(line.group(1))
        # each rank bound its own NPU (local rank -> device index) and reduced over hccl
        assert seen["set_device"] == [rank] and seen["backend"] == "hccl", seen
        assert {"get_rng_state_all", "set_rng_state_all"} <= set(seen["calls"]), seen
    print(f"hf-npu-ddp: {summaries[0]} on each rank, in {result.seconds:.0f} s")
