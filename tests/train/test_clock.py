"""The session's clock (shared/session_clock.py): training stops by --time-budget (a budget given: from the end of
the first step, so start-up never eats it; the default: from training's start) or --session-deadline (from the
session's start, start-up included), whichever comes first; start-up is measured by part; torch_xla's known
harmless messages are said once."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from helpers import REPO, SMALL_ARGS, error_lines, run_script, small_config, train_in_process

from shared.errors import UserError
from shared.runtime.xla_notices import PALLAS_NOTICE, _SayOnce, runtime_notices
from shared.session_clock import SessionClock, estimate_checkpoint_seconds, startup_line
from shared.train.metrics import read_metrics


def test_a_start_up_that_ate_20_s_ends_training_20_s_earlier_under_the_deadline():
    late = SessionClock(session_start=980.0, train_start=1000.0, budget_s=500.0, deadline_s=300.0)
    assert late.stop_at == 1280.0  # 980 + 300: the deadline counts from the session's start
    prompt = SessionClock(session_start=1000.0, train_start=1000.0, budget_s=500.0, deadline_s=300.0)
    assert prompt.stop_at - late.stop_at == 20.0
    assert SessionClock(980.0, 1000.0, budget_s=100.0, deadline_s=300.0).stop_at == 1100.0  # the budget binds
    assert SessionClock(980.0, 1000.0, budget_s=100.0).stop_at == 1100.0  # no deadline


def test_a_budget_after_start_up_counts_from_the_end_of_the_first_step_and_only_the_deadline_binds_before():
    clock = SessionClock(session_start=0.0, train_start=30.0, budget_s=240.0, deadline_s=1550.0,
                         budget_after_startup=True)
    assert clock.stop_at == 1550.0  # start-up: only the deadline, however long it takes
    clock.first_step_end = 930.0  # 900 s of probes and compiles in train()
    assert clock.stop_at == 930.0 + 240.0  # the whole budget is still training's
    clock.first_step_end = 1400.0  # start-up past its margin: the deadline cuts training, never the session
    assert clock.stop_at == 1550.0
    # The default budget (none given) is the session's whole length, from training's start, as before.
    assert SessionClock(0.0, 30.0, budget_s=240.0, deadline_s=1550.0, first_step_end=930.0).stop_at == 270.0


def test_a_first_step_after_a_long_start_up_fits_a_budget_after_start_up_but_not_one_from_trainings_start():
    import time

    now = time.monotonic()
    after = SessionClock(session_start=now - 900.0, train_start=now - 870.0, budget_s=240.0, deadline_s=1550.0,
                         budget_after_startup=True, first_step_end=now)
    after.check_first_step({"startup_s": 900.0}, checkpoint_s=35.0)  # fits: no error
    before = SessionClock(session_start=now - 900.0, train_start=now - 870.0, budget_s=240.0, deadline_s=1550.0)
    with pytest.raises(UserError, match=r"^--time-budget 240s is shorter than one step \(870\.\ds with start-up"):
        before.check_first_step({"startup_s": 900.0}, checkpoint_s=35.0)
    late = SessionClock(session_start=now - 1530.0, train_start=now - 1500.0, budget_s=240.0, deadline_s=1550.0,
                        budget_after_startup=True, first_step_end=now)
    with pytest.raises(UserError, match=r"^--session-deadline 1550s is shorter than start-up to the end of the first "
                                        r"step \(1530\.0s from the session's start\) plus a checkpoint \(~35s\)"):
        late.check_first_step({"startup_s": 1530.0}, checkpoint_s=35.0)


def test_the_start_up_line_names_each_part():
    clock = SessionClock(session_start=100.0, train_start=112.5, budget_s=60.0, parts={"packages": 9.25})
    record = clock.startup(loop_start=125.0, first_step_end=139.5, compile_s=13.0)
    assert record == {"startup_s": 39.5, "before_train_s": 12.5, "packages_s": 9.25, "runtime_and_model_s": 12.5,
                      "first_step_s": 14.5, "first_step_compile_s": 13.0}
    assert startup_line(record) == ("start-up 39.5 s to the end of the first step: 12.5 s before training (bootstrap, "
                                    "imports, packages 9.2 s), runtime and model 12.5 s, first step 14.5 s "
                                    "(compilation 13.0 s)")


def test_process_start_is_when_the_process_began_not_when_it_is_asked():
    code = ("import time; time.sleep(1.5); from shared.session_clock import process_start; "
            "print(time.monotonic() - process_start())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               cwd=REPO).stdout)
    assert 1.5 <= age < 120


def test_the_session_clock_loads_with_the_standard_library_only():
    """The bootstrap and the tokenizer read the process's start before any package is installed or torch imported."""
    code = ("import sys; import shared.session_clock; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'safetensors', 'kaggle'}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow
def test_a_session_whose_start_up_ate_its_deadline_stops_after_one_step_in_one_line_with_its_record(
        demo_data, tmp_path, suite_xla_runtime):
    import time

    cfg = small_config(demo_data, tmp_path, total_steps=100, session_deadline=30.0)
    from shared.train.trainer import train

    with pytest.raises(UserError) as err:
        train(cfg, suite_xla_runtime, log=lambda _: None, started=time.monotonic() - 29.0,
              startup_parts={"packages": 1.0})
    assert str(err.value).startswith("--session-deadline 30s is shorter than start-up to the end of the first step (")
    records = read_metrics(tmp_path / "metrics.jsonl")
    (startup,) = [r for r in records if r.get("event") == "startup"]
    assert startup["startup_s"] >= 29.0 and startup["packages_s"] == 1.0 and startup["step"] == 1
    assert records[-1]["event"] == "session_end" and records[-1]["stop_reason"] == "too_short"
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    # Without a deadline the same session trains on (its start-up is logged as a record, and the budget is unchanged).
    result, lines = train_in_process(small_config(demo_data, tmp_path / "b", total_steps=2))
    assert result.step == 2 and any(line.startswith("start-up ") for line in lines)


@pytest.mark.slow
def test_the_gpt2_smokes_session_trains_its_budget_after_600_s_of_probes_and_compiles(demo_data, tmp_path,
                                                                                     monkeypatch):
    """The smoke's session settings (examples/chain-gpt2-124m.json under --smoke) on the tiny model, on a fake clock
    that runs 30x real time and jumps 600 s where the attention probes and the step's compile would be: the session
    still trains its whole budget after its first step, and ends by its deadline, the publish margin left whole."""
    import time

    import shared.train.trainer as trainer
    from scripts.chain.config import load_config
    from scripts.chain.smoke import smoke_config
    from shared.runtime.device import make_runtime

    smoke = smoke_config(load_config(REPO / "examples" / "chain-gpt2-124m.json"))
    settings = smoke.session_clock(smoke.session_limit_s)
    real, base, jumped, scale = time.monotonic, time.monotonic(), [0.0], 30.0
    monkeypatch.setattr(time, "monotonic", lambda: base + scale * (real() - base) + jumped[0])
    probe = trainer.select_attention_and_micro_batch

    def slow_probes(*args, **kwargs):
        jumped[0] += 600.0  # the probes and compiles a TPU's start-up may take
        return probe(*args, **kwargs)

    monkeypatch.setattr(trainer, "select_attention_and_micro_batch", slow_probes)
    cfg = small_config(demo_data, tmp_path, total_steps=100_000, **settings)  # every step logged
    started = time.monotonic() - 30.0  # the imports and the bootstrap before train()
    result = trainer.train(cfg, make_runtime("cpu"), log=lambda _: None, started=started)
    records = read_metrics(tmp_path / "metrics.jsonl")
    (startup,) = [r for r in records if r.get("event") == "startup"]
    end = records[-1]
    assert result.stop_reason == "time_budget" and end["event"] == "session_end"
    # A budget counted from training's start would have ended before the first step did.
    assert startup["startup_s"] - startup["before_train_s"] > settings["time_budget"] > 240.0
    # Trained from the end of its first step to the end of its last: its budget, less the room the trainer keeps for
    # one more step and its final checkpoint (1.5 writes at its estimate: none was timed before), the step at most
    # the longest it took, the first one's included (a loaded machine's steps, at 30x, may be few: the bound says
    # so, not the clock).
    ends = [r["elapsed_s"] for r in records if "loss" in r]
    longest = max([startup["first_step_s"]] + [b - a for a, b in zip(ends, ends[1:], strict=False)])
    trained = end["elapsed_s"] - end["last_step_to_checkpoint_s"] - end["start_to_first_step_s"]
    write_s = estimate_checkpoint_seconds(cfg.model.shape.num_params())
    assert trained >= settings["time_budget"] - longest - 1.5 * write_s
    # Its final checkpoint was written by the deadline (seconds from the session's start): the publish margin is whole.
    assert startup["before_train_s"] + end["elapsed_s"] <= settings["session_deadline"]


@pytest.mark.slow
def test_the_train_kernel_counts_its_deadline_from_its_process_start(demo_data, tmp_path):
    proc = run_script("kernels/train.py", *SMALL_ARGS, "--data-dir", str(demo_data), "--out-dir", str(tmp_path),
                      "--total-steps", "50", "--session-deadline", "4")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    assert line.startswith("error: --session-deadline 4s is shorter than start-up to the end of the first step (")
    startup = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "startup"][0]
    # The interpreter, torch and the kernel's imports came before train(): counted, as the session's clock counts.
    assert startup["before_train_s"] > 0.5 and startup["startup_s"] > startup["first_step_s"] + 0.5


def test_a_known_harmless_message_is_said_once_and_every_other_passes(caplog):
    logger = logging.getLogger("gpt2k-test-notices")
    notices = []
    logger.addFilter(_SayOnce("requires jax/pallas", PALLAS_NOTICE, notices.append))
    with caplog.at_level(logging.WARNING, logger="gpt2k-test-notices"):
        for _ in range(3):
            logger.warning("You are trying to use a feature that requires jax/pallas.You can install Jax/Pallas")
        logger.warning("a real warning")
    assert notices == [PALLAS_NOTICE]
    assert [r.getMessage() for r in caplog.records] == ["a real warning"]
    # XLA's C++ warnings, explained once before they come: CPU executables that cannot be loaded; GSPMD from 2.9 on.
    (cache,) = runtime_notices("CPU", "2.8.0", restored=True)
    assert cache.startswith("notice: the checkpoint carried its compiled graphs, which torch_xla's CPU devices ")
    assert runtime_notices("TPU", "2.8.0", restored=True) == [] == runtime_notices("CPU", "2.8.0", restored=False)
    (gspmd,) = runtime_notices("TPU", "2.9.0", restored=True)
    assert gspmd.startswith("notice: torch_xla 2.9.0's XLA warns at each compilation that 'GSPMD sharding")
    assert len(runtime_notices("CPU", "2.10.1+cpu", restored=True)) == 2 and runtime_notices("CPU", None, False) == []
