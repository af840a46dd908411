"""Fixtures of the chain tests: `local_kaggle`, a local Kaggle server with a fresh root for each test
(tests/kaggle_fixtures.py, shared with tests/local_kaggle/), and `session`, this process inside a local Kaggle
session. Chain sessions run as subprocesses, so this folder never starts the XLA runtime in the test process."""

import sys

import pytest
from kaggle_fixtures import local_kaggle  # noqa: F401  (the fixture, found by pytest here)

from shared.kaggle.env import LOCAL_ROOT_ENV, LOCAL_SECRETS_ENV


@pytest.fixture
def session(tmp_path, monkeypatch):
    """This process inside a local Kaggle session (its folders under tmp_path, no secrets attached), with
    sys.path restored afterwards."""
    monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path / "kaggle"))
    monkeypatch.setenv(LOCAL_SECRETS_ENV, str(tmp_path / "secrets.json"))
    (tmp_path / "secrets.json").write_text("{}")
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path / "kaggle"
