"""``import twinkle``, the spec's import path: model classes by their registered names, ``twinkle.train``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from twinkle_core.errors import PluginNotFoundError
from twinkle_core.plugins import get_plugins


def test_a_registered_model_imports_from_twinkle_model():
    pytest.importorskip("twinkle_backend_hf")
    from twinkle.model import TransformersModel

    assert TransformersModel is get_plugins().load("model", "TransformersModel")


def test_a_model_nobody_provides_names_what_is_there():
    with pytest.raises(PluginNotFoundError, match="no model named 'TransformerModel' is installed"):
        from twinkle.model import TransformerModel  # noqa: F401


def test_import_twinkle_is_light_and_train_is_the_trainer():
    code = "import sys, twinkle; assert 'torch' not in sys.modules, 'torch imported'; print(twinkle.__version__)"
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    import twinkle
    from twinkle_core.train.loop import train

    assert twinkle.train is train
