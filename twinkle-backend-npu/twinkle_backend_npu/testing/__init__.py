"""Test support for the NPU backend: a CPU-backed fake ``torch_npu`` and the helpers built on it.

Nothing here is imported by production code. :func:`install_fake_torch_npu` is the entry point; see
:mod:`twinkle_backend_npu.testing.fake_torch_npu` for what it fakes and the one seam it replaces.
"""

from twinkle_backend_npu.testing.fake_torch_npu import FakeTorchNPU, install_fake_torch_npu

__all__ = ["FakeTorchNPU", "install_fake_torch_npu"]
