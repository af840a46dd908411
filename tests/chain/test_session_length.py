"""How long a train session lasts and when its training stops: a fixed length (Kaggle's 9 h) with its margins, or
(session_train_s) each session's training sized from what the chain's sessions measured; how much of it the plan
counts as training; and what the chain does with a session that trained no step."""

from __future__ import annotations

import json
import math

import pytest
from helpers import train_config

from scripts.chain.chain import Chain
from scripts.chain.config import config_from_dict
from scripts.chain.sizing import session_length, session_measurements, training_s
from shared.errors import UserError

BASE = {"name": "unit-run", "token_datasets": ["alice/tokens"]}
MEASURED = {**BASE, "session_limit_s": 300, "startup_margin_s": 60, "session_train_s": 30, "publish_margin_s": 20}


def test_a_fixed_session_stops_training_by_its_margins_and_never_past_its_limit_less_publishing():
    cfg = config_from_dict({**BASE, "session_limit_s": 3600, "startup_margin_s": 600, "publish_margin_s": 1200})
    assert session_length(cfg, []) == (3600, "", 0, 0)
    # The limit less both margins of training, which the trainer counts from the end of the first step (start-up is
    # not in it); from the session's start, never past limit - publish.
    assert cfg.session_clock(3600) == {"time_budget": 1800, "session_deadline": 2400}


def test_a_sessions_planned_training_is_its_budget_less_its_checkpoint_writes():
    gpt2 = train_config(preset="gpt2", micro_batch=16, checkpoint_every=1000)
    write_s = 5 + 12 * 124_475_904 / 50e6  # the trainer's estimate before a write is timed: 34.9 s
    # At one step a second: room for the final write (1.5 writes, and the 2 steps the trainer stops ahead), then
    # one write every 1,000 steps: 28 in the 29,836 s left.
    left = 29890 - 1.5 * write_s - 2 * 1.0
    assert left // (1000 + write_s) == 28
    assert training_s(29890, gpt2, 524_288, 0.0) == pytest.approx(left - 28 * write_s)
    # The evals' share makes each step longer; no periodic checkpoints, only the final one's room.
    assert training_s(3600, gpt2.replace(checkpoint_every=0), 524_288, 0.25) == pytest.approx(
        3600 - 1.5 * write_s - 2 * 1.25)
    assert training_s(10, gpt2, 524_288, 0.0) == 1.0  # a budget too short for the writes: the one step it trains


def test_sized_sessions_train_their_time_from_the_end_of_their_first_step_whatever_start_up_takes():
    cfg = config_from_dict(MEASURED)
    # Before anything is measured: 10 steps (which measure the start-up and the step time), within session_limit_s.
    assert session_length(cfg, []) == (300, "10 steps: nothing is measured before it", 10, 0)
    assert session_length(cfg, [{"n": 1, "step_s": 1.0}]).stop_after_steps == 10  # no start-up measured yet
    sessions = [{"n": 1, "startup_s": 38.9}, {"n": 2, "startup_s": 52.2}, {"n": 3}]
    # 30 s of training from the end of the first step, within session_limit_s: the longest start-up measured only
    # says what to expect (ceil(52.2 + 30 + 20) = 103), as it is no bound on the next one's.
    assert session_length(cfg, sessions) == (300, "30 s of training (session_train_s) from the end of its first "
                                                   "step, whatever start-up takes, + 20 s to publish; up to about "
                                                   "103 s after a start-up like session 2's (52.2 s)", 0, 30)
    # Steps slow enough that 30 s would not hold 10 of them: training grows to 10 steps, the 2 that end a session
    # and the room the trainer keeps for its final write (1.5 writes at its estimate, 6.65 s for these 6.87M
    # parameters, while a session's own timed write, 0.4 s, is not carried), x1.5: ceil(1.5 x (12 x 3.5 + 1.5 x
    # 6.648)) = 78.
    slow = [{"n": 1, "startup_s": 55.4, "step_s": 3.5, "checkpoint_s": 0.4}, {"n": 2, "step_s": 1.0}]
    assert cfg.train.config.model.shape.num_params() == 6_868_480
    assert session_length(cfg, slow) == (300, "78 s of training (10 steps at the 3.50 s a step session 1 took, "
                                              "x1.5, with the steps and checkpoint that end a session) from the end "
                                              "of its first step, whatever start-up takes, + 20 s to publish; up "
                                              "to about 154 s after a start-up like session 1's (55.4 s)", 0, 78)
    # No step time measured (a session killed early): still room for the final write, whose 1.5 x 6.65 s (x1.5)
    # would not fit a session_train_s this short, where the trainer would refuse the budget.
    short = config_from_dict({**MEASURED, "session_train_s": 5})
    assert session_length(short, [{"n": 1, "startup_s": 20.0}])[1:] == (
        "15 s of training (the final checkpoint's write, 6.6 s, x1.5, x1.5) from the end of its first step, whatever "
        "start-up takes, + 20 s to publish; up to about 55 s after a start-up like session 1's (20.0 s)", 0, 15)
    # A timed write longer than the estimate is the one allowed for.
    assert session_length(cfg, [{**slow[0], "checkpoint_s": 20.0}]).train_s == math.ceil(1.5 * (12 * 3.5 + 30))
    # A start-up as long as that would run training past the deadline, which then ends it: said.
    assert session_length(cfg, [{"n": 1, "startup_s": 260.0}]).why.endswith(
        "up to about 310 s after a start-up like session 1's (260.0 s); past the deadline, 280 s from its start, which "
        "then ends its training")
    # The trainer's settings: the training, counted from the end of the first step, and the deadline from the
    # session's start, which ends a start-up that runs past it; the first session has the deadline alone.
    assert cfg.session_clock(300, 64) == {"time_budget": 64, "session_deadline": 280}
    assert cfg.session_clock(300) == {"time_budget": 280, "session_deadline": 280}


def test_session_train_s_must_fit_session_limit_s_with_the_margins():
    with pytest.raises(UserError) as err:
        config_from_dict({**MEASURED, "session_train_s": 250})
    assert str(err.value) == ("config: session_train_s 250 must be >= 0, and with startup_margin_s 60 + "
                              "publish_margin_s 20 fit session_limit_s 300, the longest a session may be made")
    with pytest.raises(UserError, match="session_deadline is set by the chain"):
        config_from_dict({**BASE, "train": {"session_deadline": 100}})


def test_a_session_pushed_with_its_own_length_sends_it_as_its_timeout():
    chain = Chain(config_from_dict(MEASURED), "/tmp/unused-chain", api=None)
    assert chain.ctx.session_timeout("train-2", 113) == "113"
    assert chain.ctx.session_timeout("train-2") == "300"
    assert chain.ctx.session_timeout("eval", 113) == "300"  # the eval's is its own


def write_metrics(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_sessions_start_up_is_read_from_its_own_records_not_the_resumed_history(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    history = [{"event": "session_start", "step": 0}, {"event": "startup", "step": 1, "startup_s": 40.0},
               {"step": 1, "loss": 10.0, "elapsed_s": 30.0}, {"step": 2, "loss": 9.0, "elapsed_s": 31.0},
               {"event": "checkpoint", "step": 30, "checkpoint_s": 9.0},
               {"event": "session_end", "step": 30, "stop_reason": "time_budget"}]
    write_metrics(metrics, history + [{"event": "session_start", "step": 30},
                                      {"event": "startup", "step": 31, "startup_s": 77.5},
                                      {"event": "session_end", "step": 31, "stop_reason": "too_short"}])
    assert session_measurements(metrics) == {"startup_s": 77.5, "stop_reason": "too_short"}
    # The step time: the mean over the steps after the first two (which compile), whatever the windows' jitter.
    steps = [{"step": n, "loss": 5.0, "elapsed_s": t} for n, t in
             ((31, 40.0), (32, 52.0), (33, 54.0), (34, 54.01), (35, 58.0), (36, 58.01), (38, 62.0))]
    write_metrics(metrics, history + [{"event": "session_start", "step": 30}, *steps,
                                      {"event": "checkpoint", "step": 38, "checkpoint_s": 0.4}])
    # Steps 31 and 32 compile: from the end of step 32 to the end of step 38, (62 - 52) / 6.
    assert session_measurements(metrics) == {"step_s": 1.667, "checkpoint_s": 0.4}
    write_metrics(metrics, history + [{"event": "session_start", "step": 30}])  # killed before its first step ended
    assert session_measurements(metrics) == {}


def chain_with_sessions(tmp_path, cfg_dict: dict, sessions: list, log=None) -> Chain:
    chain = Chain(config_from_dict(cfg_dict), tmp_path / "chain", api=None, log=log or (lambda _: None))
    chain.ctx.state.data["train_sessions"] = sessions
    return chain


def test_a_session_that_trained_no_step_lengthens_the_next_or_stops_the_chain_in_one_line(tmp_path):
    lines = []
    # A sized session shorter than session_limit_s (a chain whose session_limit_s was raised since, or begun when
    # sessions were cut to their measured start-up) whose start-up outgrew it: not a failure; the next is longer.
    short = {"n": 2, "limit_s": 102, "startup_s": 95.0, "stop_reason": "too_short"}
    chain = chain_with_sessions(tmp_path / "a", MEASURED, [short], lines.append)
    assert chain.train.no_progress(short) == 0
    assert lines == ["  session 2 trained no step in its 102 s after a 95-s start-up: the next session is longer"]
    assert session_length(chain.cfg, [short])[0] == 300 > 102
    # Already at session_limit_s: no longer session would do better, so one line at once, naming the setting.
    capped = {"n": 4, "limit_s": 300, "startup_s": 290.0, "stop_reason": "too_short"}
    with pytest.raises(UserError) as err:
        chain_with_sessions(tmp_path / "b", MEASURED, [capped]).train.no_progress(capped)
    assert str(err.value) == ("stopping: train session 4 could not fit one step: its start-up took 290 s to the end "
                              "of the first step, in a session of 300 s with publish_margin_s 20; raise "
                              "session_limit_s")
    # A session of the fixed length (a real Kaggle chain) that cannot fit a step: one line at once too.
    fixed = {**BASE, "session_limit_s": 3600, "startup_margin_s": 600, "publish_margin_s": 1200}
    slow = {"n": 2, "limit_s": 3600, "startup_s": 1900.0, "stop_reason": "too_short"}
    with pytest.raises(UserError) as err:
        chain_with_sessions(tmp_path / "c", fixed, [slow]).train.no_progress(slow)
    assert str(err.value) == ("stopping: train session 2 could not fit one step: its start-up took 1900 s to the end "
                              "of the first step, in a session of 3600 s with publish_margin_s 1200; raise "
                              "session_limit_s (at most the machine's limit), or shorten start-up (its log says what "
                              "took the time, by part)")
    # Killed at its limit before its first step ended (its output discarded, nothing measured): its start-up took
    # at least the limit less publishing, and the next session allows for that.
    killed = {"n": 1, "limit_s": 132, "seconds": 133.2, "ended": 1.0, "step_before": 0, "step_after": 0}
    chain = chain_with_sessions(tmp_path / "d", MEASURED, [killed])
    assert chain.train.no_progress(killed) == 0 and killed["startup_s"] == 112
    assert session_length(chain.cfg, [killed])[0] == 300
    # After a restart those sessions still do not count against the chain; only the others do.
    from scripts.chain.train_stage import _trailing_failures

    failed = {"n": 2, "limit_s": 197, "seconds": 20.0, "ended": 1.0, "step_before": 0, "step_after": 0}
    assert [s["n"] for s in _trailing_failures([killed, failed])] == [2]
    # Any other session without progress (no start-up measured: it died early) counts against the chain.
    died = {"n": 1, "limit_s": 102, "seconds": 15.0}
    assert chain_with_sessions(tmp_path / "e", MEASURED, [died]).train.no_progress(died) == 1
