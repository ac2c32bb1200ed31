import os
import sys

import pytest

from twinkle_core.testing.isolation import process_group_scope

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module", autouse=True)
def _end_the_process_groups_this_module_started():
    """A one-rank strategy (Ulysses with sp=1 wraps in DDP) starts a group that later tests must not inherit."""
    with process_group_scope():
        yield
