"""Fixtures of the local Kaggle's own tests: `local_kaggle`, its server with a fresh root for each test
(tests/kaggle_fixtures.py, shared with tests/chain/)."""

from kaggle_fixtures import local_kaggle  # noqa: F401  (the fixture, found by pytest here)
