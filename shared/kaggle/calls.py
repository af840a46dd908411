"""A session's Kaggle API calls, each tried again after a transient fault (a 5xx, a 429 after its Retry-After, a
dropped connection: `shared.errors.is_transient`), within the time the session has left.

The kaggle client retries only 429 and connection errors, and only on an upload's start and a create (kaggle 2.2.4
kaggle_api_extended.py `with_retry` L1094 and `_is_retriable` L1032-1042, used at L5260, L5363, L5632; kaggle 2.0.2,
the CPU and GPU images', retries HTTPError alone: L703-749); kagglesdk retries nothing. Without this, one 5xx on a
status read, a file listing or the sign-in ends a publish, and a checkpoint kept in /kaggle/temp with it.

Standard library only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

from shared.errors import duration_text, http_status, is_transient, within
from shared.retry import Backoff, retrying

T = TypeVar("T")

# The waits between tries: doubling from 1 s up to 2 minutes (longer where Kaggle asks, up to that), 15 minutes in
# all for one call. How long Kaggle's faults last is not verified.
FIRST_WAIT_S, LONGEST_WAIT_S, TOTAL_WAIT_S = 1.0, 120.0, 900.0
_ends_at: list[float] = []  # the monotonic time this session's calls must be done by (calls_end_by), if any


def calls_end_by(monotonic: float | None) -> None:
    """From now on no wait between tries reaches `monotonic` (time.monotonic()): the moment the session gives up
    its publish so that its output is kept (shared/kaggle/publish.py `after_training`). None: no such moment."""
    _ends_at[:] = [] if monotonic is None else [monotonic]


def time_left() -> float:
    """Seconds until the moment set by `calls_end_by`; infinite where none is."""
    return _ends_at[0] - time.monotonic() if _ends_at else math.inf


def fault_text(err: BaseException) -> str:
    """A fault in a few words that carry no secret: its HTTP status, else its error type's name."""
    status = http_status(err)
    return f"HTTP {status}" if status is not None else type(err).__name__


def kaggle_call(fn: Callable[[], T], what: str, log: Callable[[str], None] = print,
                timeout_s: float | None = None, sleep: Callable[[float], None] = time.sleep) -> T:
    """fn() (within `timeout_s` a try, where given: the kaggle client and kagglesdk set no timeout of their own),
    tried again after each transient fault, one notice line each (`what` failed: its status; no secret). The fault
    is raised where it is not transient, after TOTAL_WAIT_S of waiting, or where the next wait would reach the
    session's moment (`calls_end_by`)."""
    backoff = Backoff(first_s=FIRST_WAIT_S, max_s=LONGEST_WAIT_S, total_s=TOTAL_WAIT_S, sleep=sleep,
                      time_left=time_left)

    def once() -> T:
        return within(timeout_s, fn) if timeout_s else fn()

    def notice(err: BaseException, wait: float) -> None:
        log(f"notice: {what} failed ({fault_text(err)}); trying again in {duration_text(wait)} "
            f"(retry {backoff.retries})")

    return retrying(once, backoff, is_transient, notice)
