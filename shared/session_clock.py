"""When this session (the kernel's process) started, and how much of a deadline counted from then is left: for the
trainer's clock (shared.train.clock) and for the bootstrap's waits before training (shared.kaggle.bootstrap), so that
a slow start-up eats training time instead of pushing past Kaggle's kill. Standard library only."""

from __future__ import annotations

import math
import os
import time

MAX_PROCESS_AGE_S = 24 * 3600  # no session is this long: an age past it (or below 0) is a clock that disagrees


def process_start() -> float:
    """The `time.monotonic()` at which this process started (Linux: /proc/self/stat's start time against the
    boot clock); elsewhere, or where the two clocks disagree (a sandboxed kernel), now. A kernel's session clock
    starts no later than its process."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time, clock ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()
    return time.monotonic() - (age if 0.0 <= age <= MAX_PROCESS_AGE_S else 0.0)


def seconds_left(deadline_s: float | None) -> float:
    """Seconds until `deadline_s` counted from the process's start (negative once past); infinite with none."""
    if not deadline_s:
        return math.inf
    return process_start() + deadline_s - time.monotonic()
