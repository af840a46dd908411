"""Fixtures of the chain tests: `local_kaggle`, a local Kaggle server with a fresh root for each test
(tests/kaggle_fixtures.py, shared with tests/local_kaggle/). Chain sessions run as subprocesses, so this folder
never starts the XLA runtime in the test process."""

from kaggle_fixtures import local_kaggle  # noqa: F401  (the fixture, found by pytest here)
