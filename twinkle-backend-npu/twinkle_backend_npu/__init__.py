"""Twinkle on Huawei Ascend NPUs (entry point ``twinkle: npu``).

Importing this package imports neither torch nor torch_npu: the accelerator imports them when it is
asked whether it can run. ``twinkle_backend_npu.testing`` holds the fake ``torch_npu`` the tests use.
"""

__version__ = "0.1.0"
