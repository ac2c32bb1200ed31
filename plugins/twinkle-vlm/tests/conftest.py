"""Shared fixtures of the VLM tests: tiny saved models per family and chat rows about coloured-square images
(the model / batch / training helpers are in :mod:`twinkle_vlm.testing`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(autouse=True, scope="session")
def _processors_without_torchvision() -> None:
    """Plain ``AutoProcessor`` calls in the tests need it too (see twinkle_vlm.compat)."""
    from twinkle_vlm.compat import allow_processors_without_torchvision

    allow_processors_without_torchvision()


COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220), "white": (250, 250, 250)}


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_vlm_dir(model_type)`` -> a directory with a tiny saved VLM (built once per session)."""
    from twinkle_vlm.testing import save_tiny_vlm

    built: dict[str, Path] = {}

    def make(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = save_tiny_vlm(model_type, tmp_path_factory.mktemp(model_type))
        return built[model_type]
    return make


@pytest.fixture(scope="session")
def colour_rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Four chat rows, each one image (a coloured square of its own size) and its colour as the answer."""
    from PIL import Image

    directory = tmp_path_factory.mktemp("images")
    rows = []
    for i, (name, rgb) in enumerate(COLOURS.items()):
        path = directory / f"{name}.png"
        Image.new("RGB", (28 + 8 * i, 30 + 4 * i), rgb).save(path)
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": str(path)},
                                         {"type": "text", "text": "What colour is this?"}]},
            {"role": "assistant", "content": name}]})
    return rows
