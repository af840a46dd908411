"""One exception type for bad input: the kernels print its message as one line and exit non-zero."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A problem with the user's input (a flag, a file, a checkpoint) that one line can explain."""


def describe_error(err: BaseException) -> str:
    """`Type: first line of the message`, at most 300 characters: a library's error inside a one-line UserError."""
    text = str(err).strip().splitlines()
    msg = text[0] if text else ""
    msg = f"{type(err).__name__}: {msg}" if msg else type(err).__name__
    return msg if len(msg) <= 300 else msg[:297] + "..."


def run_cli(main: Callable[[], T]) -> T:
    """Run a kernel/script entry point, turning a UserError into `error: ...` on stderr and exit 2."""
    try:
        return main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
