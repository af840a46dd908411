"""Fixtures of the training tests: the XLA runtime, started before the folder's first test (tests/conftest.py
`suite_xla_runtime` says why it must come before any backward pass), not when the suite is collected."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def xla_runtime_first(suite_xla_runtime):
    return suite_xla_runtime


@pytest.fixture
def xla_runtime():
    """The suite's XLA runtime (8 CPU devices); it keeps no attention choice, so each test's selection is its own."""
    from shared.runtime.device import make_runtime

    return make_runtime("xla")
