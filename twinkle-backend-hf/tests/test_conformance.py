"""The core's conformance suite, unchanged, against TransformersModel in one process."""

import pytest
from twinkle_backend_hf.testing import make_tiny_model

from twinkle_core.testing.conformance import ModelContract


class TestTransformersModelContract(ModelContract):
    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_model
