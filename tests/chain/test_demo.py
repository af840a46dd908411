"""The README's first command, `scripts/chain_sessions.py --local-demo`, as a user runs it after the test setup
(the Kaggle image stand-ins present, so every train session starts torch_xla 2.8 and installs kaggle), beside a
busy core (one taken from it, tests/helpers.py BusyCore): every train session trains at least 10 steps, its
training chosen from the step time the sessions before it measured and counted from the end of its first step, and
its log says torch_xla's harmless messages once."""

from __future__ import annotations

import json
import math
import re

import pytest
from helpers import run_script

from shared.train.metrics import last_session_records


@pytest.mark.slow
def test_the_local_demo_beside_a_busy_core_trains_ten_steps_or_more_in_every_session(tmp_path, image_pythons,
                                                                                      gpt2_ranks, busy_core):
    # One run, the harder case: the stand-ins present and a core taken (beside the suite's other worker too). The
    # same run with every core adds minutes to the suite and proves nothing this one does not.
    proc = run_script("scripts/chain_sessions.py", "--local-demo", "--workdir", str(tmp_path), timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert ("each train session trains 30 s (more where 10 steps take longer) from the end of its first step, "
            "whatever its start-up takes, then 20 s to publish, within 300 s; the first, before anything is measured, "
            "10 steps") in out
    state = json.loads((tmp_path / "chain" / "state.json").read_text())
    sessions = state["train_sessions"]
    assert len(sessions) == 3 and state["final_step"] == sessions[-1]["step_after"]
    trained = [s["step_after"] - s["step_before"] for s in sessions]
    assert all(steps >= 10 for steps in trained), (trained, out[-4000:])
    # The first measures: ended after its 10 steps, well before the longest a session may be.
    assert "train session 1 lasts at most 300 s (session_limit_s): 10 steps: nothing is measured before it" in out
    assert trained[0] == 10 and sessions[0]["seconds"] < 300 - 20
    # Each later one trains long enough for 10 steps at the slowest step time measured, counted from the end of
    # its first step: a start-up longer than the sessions' before it (a busier moment) makes it longer, never
    # shorter in steps. The longest start-up measured says what length to expect.
    chosen = re.findall(r"^train session (\d) lasts at most 300 s \(session_limit_s\): (\d+) s of training \((.*?)\) "
                        r"from the end of its first step, whatever start-up takes, \+ 20 s to publish; up to about "
                        r"(\d+) s after a start-up like session (\d)'s \(([\d.]+) s\)((?:; past the deadline, 280 s "
                        r"from its start, which then ends its training)?)$", out, re.M)
    assert [int(n) for n, *_ in chosen] == [2, 3] and [s["limit_s"] for s in sessions] == [300] * 3
    for (_, training, why, expected, longest_n, longest_s, cut), before, session in zip(
            chosen, (sessions[:1], sessions[:2]), sessions[1:], strict=True):
        # A start-up on a loaded machine long enough to run training past the deadline: then it says so.
        assert bool(cut) == (int(expected) > 300)
        assert session["train_s"] == int(training) and session["seconds"] < 300
        longest = max((s["startup_s"], s["n"]) for s in before)
        assert (f"{longest[0]:.1f}", longest[1]) == (longest_s, int(longest_n))
        assert int(expected) == math.ceil(longest[0] + int(training) + 20)  # from the unrounded start-up
        slowest = max(s["step_s"] for s in before)  # room for 10 steps at the slowest step time, and the end
        assert int(training) >= max(30, 1.5 * 12 * slowest), (training, why)
        # The trainer was given that training, counted from the end of its first step (its own record).
        start = last_session_records(tmp_path / "chain" / "sessions" / f"train-{session['n']:02d}" / "train" /
                                     "metrics.jsonl")[0]
        assert start["event"] == "session_start"
        assert (start["time_budget_s"], start["session_deadline_s"]) == (int(training), 280)

    # Each session's tokens/s as the chain printed it is the eval report's for that session: one definition, over
    # the session's finished steps (shared/train/throughput.py), not a mean or median of its log windows.
    assert chain_rates(out) == report_rates((tmp_path / "chain" / "eval" / "report.md").read_text())

    for n in (1, 2, 3):
        (log,) = (tmp_path / "chain" / "sessions" / f"train-{n:02d}").glob("*.log")
        text = "".join(e["data"] for e in json.loads(log.read_text()))
        assert re.search(r"torch_xla 2\.8\.0", text), text[:2000]  # the TPU image's stand-in
        assert ("(stop_after_steps)" if n == 1 else "(time_budget)") in text
        assert re.search(r"start-up [\d.]+ s to the end of the first step: ", text)
        # torch_xla 2.8 without jax asked for it at every sharding call (144 lines a session): now one notice.
        assert "requires jax/pallas" not in text and text.count("torch_xla asks for jax") == 1


NUMBER = r"(\d{1,3}(?:,\d{3})*)"


def chain_rates(out: str) -> list[int]:
    """The tokens/s of each train session's line the chain printed."""
    return [int(n.replace(",", "")) for n in re.findall(rf"^  session \d+ complete in .*?, {NUMBER} tokens/s", out,
                                                         re.M)]


def report_rates(report: str) -> list[int]:
    """The tokens/s by session in the eval report's throughput line."""
    by_session = re.search(r"^- throughput: .*; by session: (.*)$", report, re.M).group(1)
    return [int(n.replace(",", "")) for n in re.findall(rf"\d+: {NUMBER}", by_session)]
