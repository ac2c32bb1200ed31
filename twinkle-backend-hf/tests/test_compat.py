"""twinkle_backend_hf.compat: saving a model in a run without DeepSpeed does not import DeepSpeed (4.5 s and its
"Setting accelerator to CPU" warning at the first save), and a DeepSpeed engine is still unwrapped once DeepSpeed
is in use."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("accelerate")

SAVE = textwrap.dedent("""
    import sys
    from twinkle_backend_hf.testing import make_tiny_model
    model = make_tiny_model(seed=0)
    model.save("final", output_dir=sys.argv[1], save_optimizer=False)
    print("deepspeed imported:", "deepspeed" in sys.modules)
""")


def test_a_save_without_deepspeed_does_not_import_it(tmp_path):
    pytest.importorskip("deepspeed")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # DeepSpeed's own detection would warn
    result = subprocess.run([sys.executable, "-c", SAVE, str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "deepspeed imported: False" in result.stdout
    assert "Setting accelerator" not in result.stderr, result.stderr
    assert (tmp_path / "final" / "model.safetensors").is_file()


def test_accelerates_check_still_sees_deepspeed_once_imported(monkeypatch):
    from accelerate.utils import other
    from twinkle_backend_hf.compat import unwrap_without_importing_deepspeed

    monkeypatch.setattr(other, "is_deepspeed_available", lambda: True)  # installed, whatever this machine has
    assert unwrap_without_importing_deepspeed() is True
    assert unwrap_without_importing_deepspeed() is True  # idempotent: one wrapper
    check = other.is_deepspeed_available
    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    assert check() is False
    monkeypatch.setitem(sys.modules, "deepspeed", object())
    assert check() is True
