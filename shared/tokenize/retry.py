"""Which stream errors are worth another try, and how long to wait before it: the tokenize stream's own retries,
on top of the libraries' (huggingface_hub retries a request 5 times over about 23 s; datasets retries reads, and
from 4.4.1 on 429 and 504 too), so that a Hub fault longer than theirs costs minutes, not the part.

Standard library only.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable, Iterator

# 408 timeout, 429 rate limit, and the server-side ones a retry can outlast. 401/403/404 are not: they stay.
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
# Network errors by class name, across the HTTP stacks `datasets` has used (httpx/httpx2, requests, aiohttp, urllib3).
_TRANSIENT_NAMES = ("Timeout", "ConnectError", "ConnectionError", "NetworkError", "RemoteProtocolError", "ReadError",
                    "ProtocolError", "ChunkedEncodingError", "IncompleteRead", "ServerDisconnected",
                    "ClientPayloadError", "ClientConnectorError", "ClientOSError")


def _chain(err: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


def http_status(err: BaseException) -> int | None:
    """The HTTP status of the first reply in `err`'s chain, if any."""
    for e in _chain(err):
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
    for e in _chain(err):
        if isinstance(e, (ConnectionError, TimeoutError)):  # builtins: resets, and datasets' "Server Disconnected"
            return True
        if any(name in cls.__name__ for cls in type(e).__mro__ for name in _TRANSIENT_NAMES):
            return True
    return False


def retry_after_s(err: BaseException) -> float | None:
    """Seconds the server asked us to wait (Retry-After as seconds or a date, or the RateLimit header's `t=`)."""
    for e in _chain(err):
        headers = getattr(getattr(e, "response", None), "headers", None)
        if not headers:
            continue
        value = headers.get("Retry-After") or ""
        if value.strip().isdigit():
            return float(value)
        if value:
            try:
                return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
            except (TypeError, ValueError):
                pass
        limit = headers.get("RateLimit") or ""
        for part in limit.split(";"):
            key, _, number = part.strip().partition("=")
            if key == "t" and number.isdigit():
                return float(number)
    return None


class DeadlineReached(Exception):
    """The next try would come after the session's deadline: the part ends there, cleanly, instead."""


class Backoff:
    """Waits that double from `first_s` up to `max_s`, or what the server asked for where that is longer (up to
    `max_s`), until `total_s` of waiting is spent. A batch read between faults starts the doubling over; the total
    does not reset. `time_left`: seconds to the session's deadline; a wait that would reach it raises
    DeadlineReached."""

    def __init__(self, first_s: float = 5.0, max_s: float = 300.0, total_s: float = 1800.0,
                 sleep: Callable[[float], None] = time.sleep, time_left: Callable[[], float] | None = None) -> None:
        self.first_s, self.max_s, self.total_s, self.sleep = first_s, max_s, total_s, sleep
        self.time_left = time_left
        self.waited_s = 0.0
        self.tries = 0  # faults in a row
        self.retries = 0  # faults in all

    def progress(self) -> None:
        self.tries = 0

    def next_wait(self, err: BaseException) -> float | None:
        """The wait before the next try, or None when the total is spent."""
        wait = min(self.max_s, self.first_s * 2 ** self.tries)
        asked = retry_after_s(err)
        if asked is not None:
            wait = max(wait, min(asked, self.max_s))
        if self.waited_s + wait > self.total_s:
            return None
        if self.time_left is not None and wait >= self.time_left():
            raise DeadlineReached(f"a wait of {wait:g} s after: {err}")
        self.tries += 1
        self.retries += 1
        self.waited_s += wait
        return wait
