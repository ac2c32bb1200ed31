"""The core's conformance suite, unchanged, against TransformersModel in one process."""

import pytest
from twinkle_backend_hf.testing import make_tiny_model, make_tiny_multi_lora_model

from twinkle_core.testing.conformance import LoraTargetContract, ModelContract, TaskContract


class TestTransformersModelContract(ModelContract):
    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_model


class TestTransformersModelLoraTargets(LoraTargetContract):
    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_model


class TestTransformersModelTasks(TaskContract):
    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_model


class TestMultiLoraTenantsDisabled:
    """``disable_adapters=True`` on a multi-tenant model: the tenant named by ``adapter_name`` runs the base."""

    test_forward_only_with_adapters_disabled_is_the_base_model = \
        ModelContract.test_forward_only_with_adapters_disabled_is_the_base_model

    @pytest.fixture
    def twinkle_factory(self):
        return make_tiny_multi_lora_model
