"""A session's tokens/s from finished steps: the steps after its first log window over the time between the reads
that end them (shared/train/throughput.py), the one figure the chain, the smoke, --plan and the report use."""

import re
import statistics

import pytest

from shared.model_shape import MODEL_PRESETS
from shared.train.metrics import read_metrics
from shared.train.throughput import plot_points, run_throughput, session_throughput, split_sessions

TOKENS_PER_STEP = 1000


def host_ahead_session(steps: int, step_s: float, log_every: int = 1, start_step: int = 0, first_s: float = 30.0,
                       mfu_per_rate: float = 1e-7) -> list[dict]:
    """The step lines a session under XLA writes when every other read waits behind the next step's launch: the
    step truly finishes at first_s + (k - 1) * step_s, but odd reads come a step late and even ones at once."""
    records = [{"event": "session_start", "step": start_step, "tokens": start_step * TOKENS_PER_STEP}]
    last_read = 0.0
    for k in range(log_every, steps + 1, log_every):
        finished = first_s + (k - 1) * step_s
        read = max(finished + step_s if (k // log_every) % 2 else finished, last_read + 0.001)
        window = read - last_read if last_read else read
        rate = log_every * TOKENS_PER_STEP / window
        records.append({"step": start_step + k, "loss": 5.0, "tokens": (start_step + k) * TOKENS_PER_STEP,
                        "tokens_per_s": rate, "mfu": rate * mfu_per_rate, "mfu_llmc": rate * mfu_per_rate * 0.9,
                        "elapsed_s": read, "compiles": 1})
        last_read = read
    return records


@pytest.mark.parametrize("log_every", [1, 10])
def test_a_host_ahead_session_measures_its_true_rate_where_the_windows_mean_is_far_off(log_every):
    session = host_ahead_session(400, step_s=0.5, log_every=log_every)
    found = session_throughput(session)
    truth = TOKENS_PER_STEP / 0.5
    assert found.tokens_per_s == pytest.approx(truth, rel=0.01)
    assert found.mfu == pytest.approx(truth * 1e-7, rel=0.01)
    assert found.mfu_llmc == pytest.approx(truth * 0.9e-7, rel=0.01)
    windows = [r["tokens_per_s"] for r in session[2:]]
    if log_every == 1:  # the comb the old mean and median read: a late window, then an instant one
        assert statistics.mean(windows) > 100 * truth


def test_windows_with_an_eval_a_checkpoint_or_a_compilation_are_left_out():
    session = host_ahead_session(40, step_s=1.0, log_every=10)  # reads at ~30+9+1, 49, 69+1, 69
    session.insert(3, {"step": 20, "tokens": 20_000, "val_loss": 4.0})  # an eval after step 20
    session[4]["elapsed_s"] += 100.0  # ... that took 100 s, so step 30's read is late by that
    session[5]["elapsed_s"] += 100.0
    session[5]["compiles"] = 2  # and step 40's window compiled something
    assert [r["step"] for r in session if "loss" in r] == [10, 20, 30, 40]
    found = session_throughput(session)
    assert (found.steps, found.tokens) == (10, 10_000)  # only step 10 -> 20 is a plain window
    assert session_throughput(session[:2]) is None  # one window: nothing measured after compilation


def test_profiled_steps_are_left_out_of_the_throughput():
    # The profiler traced steps 3-5 (started once step 2 was launched, stopped once step 5 was): each took 10 s more,
    # and writing the trace held step 6's launch 20 s. Every read after comes those seconds later.
    session = host_ahead_session(40, step_s=1.0)
    for record in session[1:]:  # the step lines
        record["elapsed_s"] += {3: 10.0, 4: 20.0, 5: 30.0}.get(record["step"], 50.0 if record["step"] >= 6 else 0.0)
    steps = [r["step"] for r in session]
    session.insert(steps.index(2) + 1, {"step": 2, "event": "profile_start"})
    session.insert(steps.index(5) + 2, {"step": 5, "event": "profile_end"})
    found = session_throughput(session)
    assert found.steps == 34  # windows ending at 7..40: not those holding steps 2 (the start) to 6 (the stop)
    assert found.tokens_per_s == pytest.approx(TOKENS_PER_STEP / 1.0, rel=0.05)
    assert session_throughput([r for r in session if r.get("event") != "profile_end"]) is None  # traced to the end


def test_a_runs_throughput_sums_its_sessions_steps_and_seconds_each_without_its_first_window():
    first = host_ahead_session(100, step_s=1.0, log_every=10)
    second = host_ahead_session(100, step_s=0.25, log_every=10, start_step=100)
    records = first + second
    assert len(split_sessions(records)) == 2
    both = run_throughput(records)
    assert both.steps == 180 and both.tokens_per_s == pytest.approx(180_000 / (90 * 1.0 + 90 * 0.25), rel=0.02)
    only_second = run_throughput(records, first_step=100, last_step=200)
    assert only_second.steps == 90 and only_second.tokens_per_s == pytest.approx(4000, rel=0.02)


def test_the_throughput_plot_shows_no_comb():
    session = host_ahead_session(300, step_s=0.5, log_every=1)
    points = plot_points(session)
    rates = [rate for _, rate in points]
    assert len(points) > 200 and max(rates) / min(rates) < 1.1
    assert statistics.median(rates) == pytest.approx(2000, rel=0.02)


def test_llmc_mfu_counts_gpt2_attention_at_half():
    # llm.c's gpt2_estimate_mfu: 6 N + 6 L C T; ours (nanoGPT, PaLM): 6 N + 12 L C T (docs/tpu-throughput.md, 1)
    gpt2 = MODEL_PRESETS["gpt2"]
    assert gpt2.flops_per_token() == 860_101_632
    assert gpt2.flops_per_token_llmc() == 6 * 124_475_904 + 6 * 12 * 768 * 1024 == 803_478_528
    assert gpt2.flops_per_token() / gpt2.flops_per_token_llmc() == pytest.approx(1.0705, abs=1e-4)


class TimedSyncs:
    """A runtime's sync, wrapped to note when each step's launch returned (it waits for the step before)."""

    def __init__(self, runtime):
        self.times, self._sync = [], runtime.sync
        runtime.sync = self

    def __call__(self):
        self._sync()
        import time

        self.times.append(time.monotonic())


@pytest.mark.slow
@pytest.mark.parametrize(("log_every", "steps"), [(1, 40), (10, 50)])
def test_a_real_xla_session_reports_the_tokens_its_steps_trained_over_their_wall_time(demo_data, tmp_path,
                                                                                        log_every, steps):
    # torch_xla's CPU devices, the host a step ahead as on a TPU: the session's figure against tokens over the wall
    # time the loop itself saw between step launches (each returns once the step before it has finished).
    from helpers import small_config

    from shared.runtime.device import make_runtime
    from shared.train.trainer import train

    cfg = small_config(demo_data, tmp_path, total_steps=steps, log_every=log_every)
    runtime = make_runtime("xla")
    syncs = TimedSyncs(runtime)
    train(cfg, runtime, log=lambda *_: None)
    records = read_metrics(tmp_path / "metrics.jsonl")
    found = session_throughput(records)
    lines = {r["step"]: r for r in records if "loss" in r}
    anchor = min(s for s in lines if s > 2 and lines[s]["compiles"] == lines[steps]["compiles"] and s % log_every == 0)
    # syncs.times[k - 1]: step k's launch returned, so step k - 1 had finished; the loop makes one sync a step (the
    # eval-free, checkpoint-free run here), and the final checkpoint's syncs come after them.
    wall = syncs.times[steps - 1] - syncs.times[anchor - 1]
    truth = (steps - anchor) * cfg.step.total_batch_tokens / wall
    assert found.steps >= steps - anchor - log_every
    assert found.tokens_per_s == pytest.approx(truth, rel=0.1)


def test_the_eval_report_gives_the_runs_throughput_and_each_sessions_as_the_chain_does(tmp_path):
    import json

    from shared.eval.report import write_report

    records = host_ahead_session(100, step_s=1.0, log_every=1) + host_ahead_session(100, 0.25, 1, start_step=100)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_report(tmp_path / "eval", tmp_path / "metrics.jsonl")
    report = (tmp_path / "eval" / "report.md").read_text()
    line = next(line for line in report.splitlines() if line.startswith("- throughput:"))
    # 99 steps a session after its first window, over about 99 and 24.75 s (each give or take a step's lag)
    found = re.fullmatch(r"- throughput: ([\d,]+) tokens/s.*\(198 steps in [\d.]+ s, each session's first log window "
                         r"left out\); by session: 1: ([\d,]+), 2: ([\d,]+)", line)
    overall, first, second = (int(found.group(i).replace(",", "")) for i in (1, 2, 3))
    assert overall == pytest.approx(198_000 / (99 + 24.75), rel=0.02)
    assert (first, second) == (pytest.approx(1000, rel=0.02), pytest.approx(4000, rel=0.02))
    assert (tmp_path / "eval" / "throughput.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_profile_steps_leaves_a_trace_of_compiled_steps_for_tensorboard(demo_data, tmp_path):
    from helpers import small_config, train_in_process

    result, lines = train_in_process(small_config(demo_data, tmp_path, total_steps=6, profile_steps=2))
    assert result.step == 6
    traces = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 1000
    assert f"profiled steps 3-4 (torch_xla's profiler): {tmp_path / 'profile'}" in lines
    records = read_metrics(tmp_path / "metrics.jsonl")
    marks = [(r["event"], r["step"]) for r in records if "profile" in r.get("event", "")]
    assert marks == [("profile_start", 2), ("profile_end", 4)]  # what the throughput leaves out
    assert not any(line.startswith("notice: the profiler") for line in lines)
