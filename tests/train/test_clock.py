"""The session's clock (shared/session_clock.py): training stops by --time-budget (from training's start) or
--session-deadline (from the session's start, start-up included), whichever comes first; start-up is measured by
part; torch_xla's known harmless messages are said once."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from helpers import REPO, SMALL_ARGS, error_lines, run_script, small_config, train_in_process

from shared.errors import UserError
from shared.session_clock import SessionClock, startup_line
from shared.train.metrics import read_metrics
from shared.train.xla_notices import PALLAS_NOTICE, _SayOnce, runtime_notices


def test_a_start_up_that_ate_20_s_ends_training_20_s_earlier_under_the_deadline():
    late = SessionClock(session_start=980.0, train_start=1000.0, budget_s=500.0, deadline_s=300.0)
    assert late.stop_at == 1280.0  # 980 + 300: the deadline counts from the session's start
    prompt = SessionClock(session_start=1000.0, train_start=1000.0, budget_s=500.0, deadline_s=300.0)
    assert prompt.stop_at - late.stop_at == 20.0
    assert SessionClock(980.0, 1000.0, budget_s=100.0, deadline_s=300.0).stop_at == 1100.0  # the budget binds
    assert SessionClock(980.0, 1000.0, budget_s=100.0).stop_at == 1100.0  # no deadline


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

    cfg = small_config(demo_data, tmp_path, max_steps=100, session_deadline=30.0)
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
    result, lines = train_in_process(small_config(demo_data, tmp_path / "b", max_steps=2))
    assert result.step == 2 and any(line.startswith("start-up ") for line in lines)


@pytest.mark.slow
def test_the_train_kernel_counts_its_deadline_from_its_process_start(demo_data, tmp_path):
    proc = run_script("kernels/train.py", *SMALL_ARGS, "--data-dir", str(demo_data), "--out-dir", str(tmp_path),
                      "--max-steps", "50", "--session-deadline", "4")
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
