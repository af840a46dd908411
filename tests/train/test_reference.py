"""The early go/no-go (shared/train/reference.py): every gpt2 eval from 0.5B tokens held against a published
build-nanogpt AdamW run's curve, with a verdict from 2B tokens: go on, lengthen (and to how many steps), or stop and
change; logged, written as a metrics record (so W&B), drawn on the plot, in the report and in the chain's line."""

from __future__ import annotations

import json
import math

import pytest
from helpers import train_config

from shared.eval.report import reference_section
from shared.train import reference as ref
from shared.train.metrics import MetricsLogger, plot_loss, read_metrics
from shared.train.session import log_reference_check

BATCH = 524_288


def test_the_reference_is_the_published_runs_every_eval_to_its_end():
    steps = [s for s, _, _ in ref.REFERENCE_EVALS]
    assert steps == list(range(250, 19_001, 250)) + [19_072]
    assert ref.REFERENCE_EVALS[-1] == (19_072, 3.0656, 3079)  # its last eval: HellaSwag 3079/10042 = 0.3066
    assert ref.reference_end_tokens() == 19_072 * BATCH
    # It passes GPT-2's loss between its evals at steps 6,000 (3.3041) and 6,250 (3.2921), and GPT-2's HellaSwag
    # (its five-eval mean) well after: the loss passes first, as on FineWeb-Edu it does.
    assert 6_000 * BATCH < ref.reference_tokens_at_loss(3.2924) < 6_250 * BATCH
    assert ref.reference_tokens_at_hellaswag(0.2945) > 10_000 * BATCH
    # The goal: its mean clears 0.2945 by two standard errors of a full-set eval (0.2945 + 2 x 0.00455).
    goal = ref.goal_tokens()
    assert 14_500 * BATCH < goal < 15_000 * BATCH
    assert ref.reference_at(goal)[1] == pytest.approx(0.2945 + 2 * math.sqrt(0.2945 * 0.7055 / 10_042), abs=1e-6)


def test_a_run_on_the_references_own_curve_is_level_with_it():
    step, loss, right = ref.REFERENCE_EVALS[15]  # step 4,000, 2.10B tokens
    c = ref.check(step, step * BATCH, loss, 19_073, BATCH, hellaswag=right / 10_042)
    assert c.reference_loss == pytest.approx(loss) and c.ratio == pytest.approx(1.0, abs=1e-9)
    assert c.val_loss - c.reference_loss == pytest.approx(0.0)
    # The reference's own length is worth its own tokens: past the goal, go on; at 70% of it, short: lengthen to
    # the steps that reach the goal.
    assert c.verdict == "go on"
    short = ref.check(step, step * BATCH, loss, 13_352, BATCH)
    assert short.verdict == "lengthen" and short.steps_needed == math.ceil(ref.goal_tokens() / BATCH)
    assert "lengthen to about 14,8" in ref.check_lines(short)[1]


def test_a_run_ahead_of_the_reference_is_read_in_its_tokens_and_goes_on():
    tokens = 4_000 * BATCH
    loss = ref.REFERENCE_EVALS[23][1]  # the reference's loss at step 6,000: 1.5x these tokens
    c = ref.check(4_000, tokens, loss, 26_024, BATCH, hellaswag=0.279)
    assert c.ratio == pytest.approx(1.5, abs=1e-9) and c.reference_loss - loss == pytest.approx(3.4195 - 3.3041)
    assert c.verdict == "go on" and c.steps_needed is None
    standing, verdict = ref.check_lines(c)
    assert standing.startswith("reference check at 2.10B tokens (step 4000): val loss 3.3041 against "
                               "build-nanogpt's AdamW run's 3.4195: ahead by 0.1154, where the reference was at 3.15B "
                               "tokens (1.50x its tokens); HellaSwag 0.2790 +- ")
    assert verdict.startswith("early verdict at 2.10B tokens: go on: at 1.50x the run's 26,024 steps (13.64B tokens) "
                              "are worth 20.5B of the reference's, past the 7.")


def test_a_run_behind_plain_adamw_per_token_is_told_to_stop_and_change():
    loss = ref.REFERENCE_EVALS[7][1]  # the reference's loss at step 2,000: half these tokens
    c = ref.check(4_000, 4_000 * BATCH, loss, 26_024, BATCH)
    assert c.ratio == pytest.approx(0.5) and c.verdict == "stop and change"
    assert "needs 2.00x the reference's tokens for its loss" in c.reason


def test_hellaswag_lagging_the_reference_at_the_runs_loss_sizes_the_run_by_hellaswag():
    loss = ref.REFERENCE_EVALS[23][1]  # 1.5x ahead on the loss...
    c = ref.check(4_000, 4_000 * BATCH, loss, 13_352, BATCH, hellaswag=0.262)  # ...far behind on HellaSwag
    assert c.reference_hellaswag_at_loss - c.hellaswag > 2 * c.hellaswag_se
    hs_ratio = ref.reference_tokens_at_hellaswag(0.262) / (4_000 * BATCH)
    assert c.verdict == "lengthen" and c.steps_needed == math.ceil(ref.goal_tokens() / hs_ratio / BATCH)
    assert c.reason.startswith("HellaSwag lags the reference at this loss by ")


def test_no_check_before_half_a_billion_tokens_or_past_the_references_end_and_no_verdict_before_two():
    assert ref.check(900, 900 * BATCH, 4.0, 26_024, BATCH) is None  # 0.47B tokens
    assert ref.check(19_100, 19_100 * BATCH, 3.0, 26_024, BATCH) is None  # past 10.0B
    early = ref.check(1_000, 1_000 * BATCH, 3.9, 26_024, BATCH)
    assert early is not None and early.verdict is None and len(ref.check_lines(early)) == 1
    # a loss below the reference's final one: a ratio of at least its end over these tokens
    past = ref.check(5_000, 5_000 * BATCH, 3.0, 26_024, BATCH)
    assert past.past_end and past.ratio == pytest.approx(19_072 / 5_000) and past.verdict == "go on"


def test_a_gpt2_eval_is_logged_recorded_drawn_reported_and_summed_up_for_the_chain(tmp_path):
    lines: list[str] = []
    logger = MetricsLogger(tmp_path, 26_024, 0, {}, progress=False, log=lines.append)
    cfg = train_config(preset="gpt2", total_steps=26_024)
    log_reference_check(cfg, logger, 500, {"val_loss": 4.5})  # 0.26B tokens: nothing yet
    log_reference_check(cfg, logger, 2_000, {"val_loss": 3.55})
    log_reference_check(cfg, logger, 4_000, {"val_loss": 3.3041, "hellaswag_acc_norm": 0.279,
                                             "hellaswag_examples": 10_042})
    log_reference_check(train_config(preset="tiny", total_steps=26_024), logger, 4_000, {"val_loss": 3.3})
    records = read_metrics(logger.path)
    assert [r["step"] for r in records] == [2_000, 4_000] and all(r["event"] == "reference" for r in records)
    assert "reference_verdict" not in records[0] and records[1]["reference_verdict"] == "go on"
    assert records[1]["reference_tokens_ratio"] == pytest.approx(1.5, abs=1e-9)
    assert records[1]["hellaswag_vs_reference"] == pytest.approx(0.279 - ref.reference_at(4_000 * BATCH)[1])
    assert [line.split(":")[0] for line in lines] == ["reference check at 1.05B tokens (step 2000)",
                                                      "reference check at 2.10B tokens (step 4000)",
                                                      "early verdict at 2.10B tokens"]
    json.dumps(records)  # W&B gets the same fields (MetricsLogger.write)
    tokens, losses, hellaswag, name = ref.published_curve(records)
    assert tokens[0] >= 0.5e9 and tokens[-1] <= 4_000 * BATCH and len(tokens) == len(losses) == len(hellaswag)
    assert losses[0] == ref.REFERENCE_EVALS[3][1] and name == ref.REFERENCE_NAME  # from step 1,000 (0.52B tokens)
    assert plot_loss(logger.path, tmp_path / "loss.png", published=(tokens, losses, hellaswag, name)).stat().st_size
    report = reference_section(records)
    assert report[0] == "## Against a published run" and "garg-aayush/building-from-scratch" in report[2]
    assert report[3].startswith("- early verdict (step 4000): go on: at 1.50x")
    assert ref.summary_line(records[-1]) == ("against build-nanogpt's AdamW run at 2.10B tokens: val loss ahead by "
                                             f"0.1154 (1.50x its tokens), HellaSwag "
                                             f"{records[-1]['hellaswag_vs_reference']:+.4f}; early verdict: go on")
