"""The trainer's per-window step timing (issue 19): host trace, sync, device time and device-busy per step, from
the runtime's running totals, against a direct computation."""

import pytest
import torch

from shared.train import trainer
from shared.train.session import StepLog, step_timing


class FakeRuntime:
    """Running totals set by the test, as an XLA runtime reports them."""

    def __init__(self):
        self.timers = {"execute_s": 0.0, "device_waits": 0.0}
        self.d2h = 0

    def peak_flops(self):
        return 1e12

    def device_timers(self):
        return dict(self.timers)

    def transfer_counts(self):
        return 7, self.d2h

    def compile_count(self):
        return 3

    def execution_count(self):
        return 11

    def mean_across(self, value):
        return value


class Inline:
    """BackgroundCalls, run at once (the order is what the trainer relies on, not the thread)."""

    def flush(self):
        pass

    def submit(self, fn, *args):
        fn(*args)


class Lines:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(record)


def test_step_timing_divides_device_time_by_the_windows_wall_time():
    record = step_timing({"execute_s": 0.3, "device_waits": 0.5}, host_trace_s=0.05, sync_s=0.012, step_s=0.4)
    assert record == {"host_trace_ms": 50.0, "sync_ms": 12.0, "device_ms": 300.0, "device_busy": 0.75,
                      "device_waits": 0.5}
    # A backend without device timers (CPU, CUDA) logs the host's two figures only; busy never exceeds 1.
    assert step_timing({}, 0.002, 0.001, 1.0) == {"host_trace_ms": 2.0, "sync_ms": 1.0}
    assert step_timing({"execute_s": 2.0, "device_waits": 0.0}, 0.0, 0.0, 1.0)["device_busy"] == 1.0


def test_each_log_line_reports_its_own_window_per_step(monkeypatch):
    clock = iter([100.0, 104.0, 110.0])  # the window starts at 100 s; lines at 104 s (4 steps) and 110 s (2 steps)
    monkeypatch.setattr(trainer.time, "monotonic", lambda: next(clock))
    runtime, lines = FakeRuntime(), Lines()
    log = StepLog(runtime, lines, Inline(), step=10, tokens_per_step=1000, flops_per_token=6e6,
                  session_start=90.0)
    scalar = torch.tensor(2.5)
    runtime.timers = {"execute_s": 3.2, "device_waits": 1.0}
    runtime.d2h = 3
    log.queue(14, scalar, torch.tensor(0.5), torch.tensor(1e-3), host_trace_s=0.4, sync_s=0.08)
    runtime.timers = {"execute_s": 3.2 + 1.5, "device_waits": 1.0}
    log.queue(16, scalar, torch.tensor(0.5), torch.tensor(1e-3), host_trace_s=0.4 + 0.3, sync_s=0.08 + 0.02)
    first, second = lines.records
    assert first["step"] == 14 and first["tokens"] == 14_000 and first["elapsed_s"] == 14.0
    assert first["tokens_per_s"] == 1000.0 and first["mfu"] == 1000.0 * 6e6 / 1e12
    assert (first["host_trace_ms"], first["sync_ms"], first["device_ms"]) == (100.0, 20.0, 800.0)
    assert (first["device_busy"], first["device_waits"]) == (0.8, 0.25)  # 3.2 s of 4 s; 1 wait in 4 steps
    assert (first["compiles"], first["graphs"], first["h2d_transfers"], first["d2h_transfers"]) == (3, 11, 7, 3)
    # The second window holds only what happened since the first line: 2 steps, 6 s, 1.5 s of device time.
    assert second["tokens_per_s"] == round(2 * 1000 / 6.0, 1)
    assert (second["host_trace_ms"], second["sync_ms"], second["device_ms"]) == (150.0, 10.0, 750.0)
    assert (second["device_busy"], second["device_waits"]) == (0.25, 0.0)
    assert log.last_loss == 2.5


def test_drain_waits_for_a_running_background_call_and_raises_nothing():
    """A session ending on an error drains the logging thread before its process exits: the thread may be inside a
    device read, and torch_xla aborts a process that exits meanwhile."""
    import threading

    from shared.train.metrics import BackgroundCalls

    release, done = threading.Event(), []
    calls = BackgroundCalls(threaded=True)

    def slow_read():
        release.wait(5)
        done.append("read")

    def failing():
        raise RuntimeError("device read failed")

    calls.submit(slow_read)
    calls.submit(failing)
    threading.Timer(0.2, release.set).start()
    calls.drain()  # returns only after both ran, and does not raise the second's error
    assert done == ["read"] and calls._queue.unfinished_tasks == 0
    with pytest.raises(RuntimeError, match="device read failed"):
        calls.flush()  # the error is still there for the loop's own flush
