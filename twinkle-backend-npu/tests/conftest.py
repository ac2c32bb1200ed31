import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

_HCCL_ENV = ("HCCL_IF_BASE_PORT", "HCCL_HOST_SOCKET_PORT_RANGE", "HCCL_NPU_SOCKET_PORT_RANGE",
             "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")


@pytest.fixture(autouse=True)
def _restore_hccl_env():
    """The npu accelerator writes HCCL variables into os.environ; put them back so tests stay independent."""
    saved = {name: os.environ.get(name) for name in _HCCL_ENV}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture
def fake_npu(monkeypatch):
    """The fake torch_npu (8 Ascend 910B devices, bf16) installed, and the npu accelerator forced."""
    from twinkle_backend_npu.testing import install_fake_torch_npu

    from twinkle_core.testing.isolation import describe_leaked_group

    leaked = describe_leaked_group()
    if leaked:  # a model built now would reduce over that group, not over (fake) HCCL
        pytest.fail(leaked)
    monkeypatch.setenv("TWINKLE_ACCELERATOR", "npu")
    with install_fake_torch_npu() as fake:
        yield fake
