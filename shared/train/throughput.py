"""A session's training throughput, one definition for every place that reports it (the chain's line, the smoke's
readiness report and the rate it records for --plan, the eval report and its plot).

Each step line in metrics.jsonl is written when its loss is read, and a read waits for that step to finish on the
device. But under XLA the host runs a step ahead, and the read can wait behind the next step's launch too (the
loop's sync takes the device first): one window then holds two steps' time and the next almost none. With
`log_every: 1` a window's own rate swings from about half the truth to a thousand times it, so a mean or a median
of windows is not a measure. Their sum is: the time between two reads is the time the steps between them took to
finish, give or take one step at each end. So a session's tokens/s is the tokens of its steps after the first
window (which holds compilation), over the time between the reads that end them; windows that hold an eval, a
checkpoint or a compilation are left out, as `--plan` counts evals and start-up apart (`eval_share`), and so are
those that hold a profiled step (the trainer's `profile_start` and `profile_end` records): the profiler's trace
slows the steps it records, and stopping it writes the trace.
"""

from __future__ import annotations

from dataclasses import dataclass

# The plot's points: each the rate over the trailing windows that cover at least this share of the session's
# measured steps, and at least PLOT_SPAN_STEPS of them where it has that many (a window's read is late or early by up
# to a step: over 10 steps that is 10% at most), and at least two windows (a late read and its early neighbour).
PLOT_SPAN_SHARE, PLOT_SPAN_STEPS = 0.1, 10
# Records written between two step lines that take no time of their own (the start-up record follows step 1's line).
QUIET_RECORDS = ("session_start", "startup")


@dataclass(frozen=True)
class Throughput:
    """Training throughput over `steps` steps (`tokens` tokens) that took `seconds`."""

    tokens: int
    steps: int
    seconds: float
    mfu: float | None = None  # the trainer's FLOP count, 6N + 12LCT (nanoGPT's and PaLM's convention)
    mfu_llmc: float | None = None  # llm.c's, 6N + 6LCT (its gpt2_estimate_mfu): causal attention counted half

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def describe(self) -> str:
        """'1,234 tokens/s, MFU 41.2% (llm.c's count 39.0%)', or without MFU where the peak is unknown."""
        text = f"{self.tokens_per_s:,.0f} tokens/s"
        if self.mfu is not None:
            text += f", MFU {self.mfu:.1%}"
            if self.mfu_llmc is not None:
                text += f" (llm.c's count {self.mfu_llmc:.1%})"
        return text


def is_step_line(record: dict) -> bool:
    """A training step's metric line (what the trainer's StepLog writes)."""
    return record.get("loss") is not None and "tokens_per_s" in record and "event" not in record


def split_sessions(records: list[dict]) -> list[list[dict]]:
    """A metrics history cut at each `session_start` record (a history with none is one session)."""
    sessions: list[list[dict]] = []
    for record in records:
        if record.get("event") == "session_start" or not sessions:
            sessions.append([])
        sessions[-1].append(record)
    return sessions


@dataclass(frozen=True)
class _Window:
    end: dict  # the step line that ends it
    tokens: int
    steps: int
    seconds: float


def _profiled(session: list[dict]) -> list[tuple[int, float]]:
    """The steps (first, last) a session's profiler may have slowed: from the step after which its trace started
    (that step may still be running) to the one after the last traced (its launch waited for the trace to be
    written); to the session's end where no `profile_end` record came."""
    spans: list[tuple[int, float]] = []
    for record in session:
        if record.get("event") == "profile_start":
            spans.append((record["step"], float("inf")))
        elif record.get("event") == "profile_end" and spans:
            spans[-1] = (spans[-1][0], record["step"] + 1)
    return spans


def _windows(session: list[dict]) -> list[_Window]:
    """The session's log windows after its first, without those that hold an eval, a checkpoint, a compilation
    (step 2's graph is compiled too: with `log_every: 1` that is the second window) or a profiled step."""
    profiled = _profiled(session)
    windows, previous, interrupted = [], None, False
    for record in session:
        if not is_step_line(record):
            interrupted = interrupted or (previous is not None and record.get("event") not in QUIET_RECORDS)
            continue
        if "elapsed_s" not in record:  # an older line: no read time to measure with
            return []
        compiled = record.get("compiles") != previous.get("compiles") if previous is not None else True
        measured = previous is not None and not (interrupted or compiled) and record["step"] > previous["step"]
        if measured and not any(record["step"] >= first and previous["step"] < last for first, last in profiled):
            windows.append(_Window(record, record["tokens"] - previous["tokens"], record["step"] - previous["step"],
                                   record["elapsed_s"] - previous["elapsed_s"]))
        previous, interrupted = record, False
    return windows


def _over(windows: list[_Window]) -> Throughput | None:
    if not windows:
        return None
    seconds = sum(w.seconds for w in windows)
    tokens = sum(w.tokens for w in windows)
    if seconds <= 0:
        return None
    rate = tokens / seconds

    def scaled(key: str) -> float | None:  # a line's MFU over its rate is FLOPs per token over the peak
        last = windows[-1].end
        value, its_rate = last.get(key), last.get("tokens_per_s")
        return value / its_rate * rate if value is not None and its_rate else None

    return Throughput(tokens, sum(w.steps for w in windows), seconds, scaled("mfu"), scaled("mfu_llmc"))


def session_throughput(session: list[dict]) -> Throughput | None:
    """One session's throughput (its records, as `split_sessions` gives them); None where it logged fewer than two
    step lines, or none after the first window without an eval or checkpoint in it."""
    return _over(_windows(session))


def run_throughput(records: list[dict], first_step: int = 0, last_step: int | None = None) -> Throughput | None:
    """The throughput of every session in a metrics history whose step lines fall in (first_step, last_step]: their
    steps and seconds summed (each session's first window left out, as `session_throughput` does)."""
    windows = [w for session in split_sessions(records) for w in _windows(session)
               if first_step < w.end["step"] and (last_step is None or w.end["step"] <= last_step)]
    return _over(windows)


def plot_points(session: list[dict], span_share: float = PLOT_SPAN_SHARE) -> list[tuple[int, float]]:
    """(tokens, tokens/s) for a throughput plot of one session: at each window's end, the rate over the trailing
    windows covering at least `span_share` of the session's measured steps (and PLOT_SPAN_STEPS) and at least two
    windows (so no comb of late reads and early ones); none before the first such span."""
    windows = _windows(session)
    measured = sum(w.steps for w in windows)
    span = max(1, min(measured, max(PLOT_SPAN_STEPS, round(span_share * measured))))
    points = []
    for i in range(len(windows)):
        j, steps = i, windows[i].steps
        while j > 0 and (steps < span or i - j < 1):
            j -= 1
            steps += windows[j].steps
        if steps >= span and (i - j >= 1 or len(windows) == 1):
            found = _over(windows[j:i + 1])
            if found:
                points.append((windows[i].end["tokens"], found.tokens_per_s))
    return points
