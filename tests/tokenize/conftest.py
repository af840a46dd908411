"""The tokenize tests' session fixtures (tokenize_fixtures.py), so both files share one corpus and one reference
run."""

from tokenize_fixtures import corpus, enc, ranks, reference  # noqa: F401
