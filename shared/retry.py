"""How long to wait before another try after a transient fault (which errors are worth one: `shared.errors.
is_transient`), and `retrying`, a call tried again after each. Used by the tokenize stream, on top of the libraries'
own retries (huggingface_hub retries a request 5 times over about 23 s; datasets retries reads, and from 4.4.1 on 429
and 504 too), so that a Hub fault longer than theirs costs minutes, not the part; and by a session's Kaggle calls
(shared/kaggle/calls.py), which the kaggle client retries only on 429 and connection errors, and only on an upload's
start and a create.

Standard library only.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable
from typing import TypeVar

from shared.errors import error_chain

T = TypeVar("T")


def retry_after_s(err: BaseException) -> float | None:
    """Seconds the server asked us to wait (Retry-After as seconds or a date, or the RateLimit header's `t=`)."""
    for e in error_chain(err):
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


def retrying(fn: Callable[[], T], backoff: Backoff, transient: Callable[[BaseException], bool],
             on_retry: Callable[[BaseException, float], None] | None = None) -> T:
    """fn(), tried again after each fault that `transient` accepts, once `backoff` has waited (`on_retry(fault,
    wait)` first); the fault itself is raised where it is not transient, where the backoff's total is spent, or
    where the wait would reach its deadline."""
    while True:
        try:
            return fn()
        except Exception as err:
            if not transient(err):
                raise
            try:
                wait = backoff.next_wait(err)
            except DeadlineReached:
                wait = None
            if wait is None:
                raise
            if on_retry is not None:
                on_retry(err, wait)
            backoff.sleep(wait)
