import os
import sys
import warnings

import pytest

from twinkle_core.testing.isolation import process_group_scope

sys.path.insert(0, os.path.dirname(__file__))
# megatron-core warns at import that Transformer Engine / Apex are absent (expected on CPU)
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def _destroy_megatron_parallel_state() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module", autouse=True)
def _end_the_process_groups_this_module_started():
    """megatron-core needs a process group even on one rank; the strategy starts one (and megatron's parallel
    groups on it) that later modules, and other distributions' tests, must not inherit."""
    with process_group_scope(before_destroy=_destroy_megatron_parallel_state):
        yield
