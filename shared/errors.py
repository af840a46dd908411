"""One exception type for bad input: the kernels print its message as one line and exit non-zero."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class UserError(Exception):
    """A problem with the user's input (a flag, a file, a checkpoint) that one line can explain."""


def describe_error(err: BaseException, secrets: list[str] | tuple[str, ...] = ()) -> str:
    """One line, at most 300 characters, for a library's error inside a one-line message: `HTTP <status>` for an
    API reply (with the reply's own `message` where it has one), else the error's type, then the first line of its
    message. Each of `secrets`, and any basic-auth header, is masked before anything is cut."""
    response = getattr(err, "response", None)
    status = getattr(response, "status_code", None)
    detail = ""
    if response is not None:
        try:
            detail = response.json().get("message", "")
        except Exception:  # a reply that is not JSON: the error's own text
            detail = ""
    text = str(detail or err)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = re.sub(r"(?i)(authorization: *basic )\S+", r"\1***", text)
    lines = text.strip().splitlines()
    head = f"HTTP {status}" if status else type(err).__name__
    msg = f"{head}: {lines[0]}" if lines else head
    return msg if len(msg) <= 300 else msg[:297] + "..."


def run_cli(main: Callable[[], T]) -> T:
    """Run a kernel/script entry point, turning a UserError into `error: ...` on stderr and exit 2."""
    try:
        return main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def duration_text(seconds: float) -> str:
    """A wait as a person reads it: "0.2 s", "45 s", "12 minutes"."""
    return f"{seconds:.3g} s" if seconds < 120 else f"{seconds / 60:.0f} minutes"


def within(seconds: float, fn: Callable[[], T]) -> T:
    """fn(), or a UserError ("no answer within ...") once it has run `seconds`; it goes on in a daemon thread, gone
    when the process ends. For calls that may hang a session until its kill (a fetch, an API call with no timeout
    of its own, a device probe)."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # handed to the caller's thread
            result["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise UserError(f"no answer within {duration_text(seconds)}")
    if "error" in result:
        raise result["error"]
    return result["value"]
