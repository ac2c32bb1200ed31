"""The conformance suite passes against the reference backend, and fails backends that break it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from twinkle_core.testing.conformance import LoraTargetContract, ModelContract, TaskContract
from twinkle_core.testing.reference import make_reference_model


class TestReferenceBackend(ModelContract):
    @pytest.fixture
    def twinkle_factory(self):
        return make_reference_model


class TestReferenceBackendLoraTargets(LoraTargetContract):
    @pytest.fixture
    def twinkle_factory(self):
        return make_reference_model


class TestReferenceBackendTasks(TaskContract):
    @pytest.fixture
    def twinkle_factory(self):
        return make_reference_model


BROKEN_BACKENDS = {
    "zero_grad_norm": ("clip_grad_norm", "def clip_grad_norm(self, max_grad_norm=1.0, norm_type=2.0, *, "
                       "adapter_name=None):\n        return 0.0", "test_clip_grad_norm_returns_true_norm_and_clips"),
    "ignores_max_grad_norm": ("clip_grad_norm", "def clip_grad_norm(self, max_grad_norm=1.0, norm_type=2.0, *, "
                              "adapter_name=None):\n        return super().clip_grad_norm(float('inf'), norm_type, "
                              "adapter_name=adapter_name)", "test_max_grad_norm_changes_the_update"),
    "forward_raises": ("forward", "def forward(self, *, inputs, adapter_name=None, **kw):\n        "
                       "raise NotImplementedError", "test_forward_returns_logits"),
    "mean_not_token_sum": ("backward", "def backward(self, *, loss=None, adapter_name=None, **kw):\n"
                           "        from twinkle_core.loss.base import LossOutput\n"
                           "        loss = self.train_state(adapter_name).last_loss if loss is None else loss\n"
                           "        super().backward(loss=LossOutput(loss.mean, 1), adapter_name=adapter_name)",
                           "test_gradient_accumulation_is_exact"),
    "ignores_disable_adapters": ("forward_only", "def forward_only(self, *, inputs, adapter_name=None, "
                                 "disable_adapters=False, **kw):\n        return super().forward_only(inputs=inputs, "
                                 "adapter_name=adapter_name)",
                                 "test_forward_only_with_adapters_disabled_is_the_base_model"),
    "claims_a_value_head": ("supported_model_kinds", "supported_model_kinds = ('causal_lm', 'token_value')",
                            "test_each_model_kind_is_built_or_refused_before_building and token_value"),
    "frozen_copy_trains": ("_trains", "frozen = property(lambda self: False, lambda self, value: None)",
                           "test_frozen_copy_matches_and_refuses_to_train"),
}


@pytest.mark.parametrize("breakage", sorted(BROKEN_BACKENDS))
def test_suite_fails_a_backend_that_breaks_the_contract(tmp_path, breakage):
    _, method, test_name = BROKEN_BACKENDS[breakage]
    module = tmp_path / "broken_backend.py"
    module.write_text(textwrap.dedent('''
        from twinkle_core.testing.reference import ReferenceModel

        class Broken(ReferenceModel):
            {method}

        def make(**options):
            return Broken(**options)
    ''').replace("{method}", textwrap.indent(method, "    ").strip()))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
         "twinkle_core.testing.conformance", "--twinkle-backend", "broken_backend:make", "-k", test_name],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed" in result.stdout or "failed" in result.stdout, result.stdout
