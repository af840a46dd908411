"""One exception type for bad input: the kernels print its message as one line and exit non-zero. Also a library's
error read: in one line (`describe_error`), its HTTP status, and whether another try may pass (`is_transient`)."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable, Iterator
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


# 408 timeout, 429 rate limit, and the server-side ones a retry can outlast. 401/403/404 are not: they stay.
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# Network errors by class name, across the HTTP stacks our libraries use (httpx/httpx2, requests, aiohttp, urllib3).
_TRANSIENT_NAMES = ("Timeout", "ConnectError", "ConnectionError", "NetworkError", "RemoteProtocolError", "ReadError",
                    "ProtocolError", "ChunkedEncodingError", "IncompleteRead", "ServerDisconnected",
                    "ClientPayloadError", "ClientConnectorError", "ClientOSError")


def error_chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, then what caused it, and so on (each once)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def http_status(err: BaseException) -> int | None:
    """The HTTP status of the first reply in `err`'s chain, if any."""
    for e in error_chain(err):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
    return None


def is_transient(err: BaseException) -> bool:
    """Whether `err` (or what caused it) is a fault another try may not meet: a retryable HTTP status, a dropped or
    timed-out connection. Bad data, a missing file and refused credentials are not."""
    status = http_status(err)
    if status is not None:
        return status in TRANSIENT_STATUS
    for e in error_chain(err):
        if isinstance(e, (ConnectionError, TimeoutError)):  # builtins: resets, and datasets' "Server Disconnected"
            return True
        if any(name in cls.__name__ for cls in type(e).__mro__ for name in _TRANSIENT_NAMES):
            return True
    return False
