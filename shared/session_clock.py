"""The session's clock, all of it here: when the session (the kernel's process) started and how much of a deadline
counted from then is left (`process_start`, `seconds_left`: for the trainer and for the bootstrap's and tokenizer's
waits before and around the work), and `SessionClock`, when the training loop must stop so that its final checkpoint
(and the publish after it) lands before the session's time limit, whatever start-up took, and what start-up spent,
by part.

Two limits for training, whichever comes first:
- `--time-budget`: seconds of training counted from the end of the session's first step, so start-up (PJRT, the
  attention probes, W&B, the baseline eval, the step's compile) never eats the training it asks for; without one,
  the default (a 9-h Kaggle session less its margins) is the session's whole length, counted from `train()`'s start;
- `--session-deadline`: seconds counted from the session's own start (the kernel's process start), so a slow
  package install, checkpoint fetch or import eats training time instead of pushing the end past the kill.

A common module, not a stage's (the bootstrap and the tokenizer use the process's start too): the standard library
and shared.config / shared.errors only (themselves standard library only), so a kernel reads its start before any
package is installed or torch imported.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from shared.config import NINE_HOURS
from shared.errors import UserError
from shared.model_shape import CHECKPOINT_BYTES_PER_PARAM

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


def estimate_checkpoint_seconds(num_params: int) -> float:
    """Before a checkpoint has been timed: its bytes (weights + AdamW) at a cautious 50 MB/s."""
    return 5.0 + CHECKPOINT_BYTES_PER_PARAM * num_params / 50e6


def default_time_budget(checkpoint_seconds: float) -> float:
    """A Kaggle session's 9 h less start-up and publishing (10 min) and three checkpoint writes' worth: the
    loop also stops early enough for one more step and 1.5 checkpoints, so the kill never meets a half write."""
    return NINE_HOURS - (600 + 3 * checkpoint_seconds)


@dataclass
class SessionClock:
    """The session's time: `session_start` (monotonic: the process's start, or train()'s where not given),
    `train_start` (train()'s), and the seconds of each limit. `parts`: start-up measured before train(), by name
    (e.g. the packages installed), for the start-up line. `budget_after_startup`: the budget counts from the end of
    the first step (`first_step_done`), so start-up cannot eat it; before then only the deadline binds. Otherwise
    it counts from train()'s start (the default budget: a whole session's length)."""

    session_start: float
    train_start: float
    budget_s: float
    deadline_s: float = 0.0
    parts: dict = field(default_factory=dict)
    budget_after_startup: bool = False
    first_step_end: float | None = None

    @property
    def budget_start(self) -> float:
        """Where the budget counts from (infinitely late while a budget after start-up waits for the first step)."""
        if not self.budget_after_startup:
            return self.train_start
        return math.inf if self.first_step_end is None else self.first_step_end

    @property
    def stop_at(self) -> float:
        """The monotonic time by which training (with its final checkpoint) must be done."""
        deadline = self.session_start + self.deadline_s if self.deadline_s else math.inf
        return min(self.budget_start + self.budget_s, deadline)

    def left_s(self) -> float:
        return self.stop_at - time.monotonic()

    def since_session(self, at: float | None = None) -> float:
        return (time.monotonic() if at is None else at) - self.session_start

    def startup(self, loop_start: float, first_step_end: float, compile_s: float) -> dict:
        """What start-up spent up to the end of the first step, by part (seconds): the `startup` record."""
        return {"startup_s": round(first_step_end - self.session_start, 3),
                "before_train_s": round(self.train_start - self.session_start, 3),
                **{f"{name}_s": round(seconds, 3) for name, seconds in self.parts.items()},
                "runtime_and_model_s": round(loop_start - self.train_start, 3),
                "first_step_s": round(first_step_end - loop_start, 3), "first_step_compile_s": round(compile_s, 3)}

    def first_step_done(self, step: int, loop_start: float, first_step_end: float, compile_s: float,
                        checkpoint_s: float, write, log) -> None:
        """At the end of the session's first step: its start-up as a record (`write`) and a line (`log`); where a
        checkpoint no longer fits, a `too_short` session end recorded, then the one-line error. A budget after
        start-up starts here."""
        self.first_step_end = first_step_end
        startup = self.startup(loop_start, first_step_end, compile_s)
        write({"event": "startup", "step": step, **startup})
        log(startup_line(startup))
        try:
            self.check_first_step(startup, checkpoint_s)
        except UserError:
            write({"event": "session_end", "step": step, "stop_reason": "too_short", **startup})
            raise

    def check_first_step(self, startup: dict, checkpoint_s: float) -> None:
        """One step and a checkpoint must fit: else one line naming the limit that binds."""
        if time.monotonic() + checkpoint_s <= self.stop_at:
            return
        if self.deadline_s and self.session_start + self.deadline_s < self.budget_start + self.budget_s:
            raise UserError(f"--session-deadline {self.deadline_s:g}s is shorter than start-up to the end of the "
                            f"first step ({startup['startup_s']:.1f}s from the session's start) plus a checkpoint "
                            f"(~{checkpoint_s:.0f}s)")
        raise UserError(f"--time-budget {self.budget_s:g}s is shorter than one step "
                        f"({time.monotonic() - self.train_start:.1f}s with start-up and compilation) "
                        f"plus a checkpoint (~{checkpoint_s:.0f}s)")


def startup_line(record: dict) -> str:
    """The start-up record as one log line."""
    before = [f"{name[:-2].replace('_', ' ')} {record[name]:.1f} s" for name in record
              if name.endswith("_s") and name not in _STARTUP_FIELDS]
    return (f"start-up {record['startup_s']:.1f} s to the end of the first step: {record['before_train_s']:.1f} s "
            f"before training (bootstrap, imports{', ' + ', '.join(before) if before else ''}), runtime and model "
            f"{record['runtime_and_model_s']:.1f} s, first step {record['first_step_s']:.1f} s (compilation "
            f"{record['first_step_compile_s']:.1f} s)")


_STARTUP_FIELDS = {"startup_s", "before_train_s", "runtime_and_model_s", "first_step_s", "first_step_compile_s"}
