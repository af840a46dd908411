"""The decay-aware projection (shared/train/projection.py): a wsd run's final val loss and HellaSwag from its stable
phase, and the recommendation --extend and the stable phase's eval print (issue 32)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from helpers import small_config, train_in_process

from shared.config import TrainConfig
from shared.train.metrics import GPT2_124M_VAL_LOSS, read_metrics
from shared.train.optim import stable_phase_end
from shared.train.projection import (
    PUBLISHED_DECAYS,
    decay_gains,
    log_slope,
    project,
    project_final_loss,
    project_hellaswag,
    summary_line,
)

RECIPE = TrainConfig(preset="gpt2", optimizer="muon", schedule="wsd", max_steps=10000, cooldown_frac=0.3)


def test_the_published_decays_give_a_drop_of_about_fourteen_percent_per_unit_of_cooldown():
    gains = decay_gains()
    assert len(gains) == len(PUBLISHED_DECAYS) == 7
    # the 2024-10-10 Muon record: 3.4157 at step 4,375 to 3.2785 at 6,200 over a 1,800-step decay
    assert gains[0] == pytest.approx((3.4157 - 3.2785) / 3.4157 / (1800 / 6200))
    assert 0.137 < min(gains) and max(gains) < 0.172
    band = project_final_loss(3.4157, 1800 / 6200)
    assert band.low < 3.2785 < band.high  # the record's own end lies inside the band
    assert band.mid == pytest.approx(3.4157 * (1 - sorted(gains)[3] * 1800 / 6200))


def test_hellaswag_is_read_off_the_runs_own_loss_to_accuracy_line():
    pairs = [(4.0, 0.26), (3.8, 0.27), (3.6, 0.28), (3.5, 0.285)]  # exactly acc = 0.46 - 0.05 loss
    band = project_hellaswag(pairs, project_final_loss(3.4, 0.3))
    mid_loss = project_final_loss(3.4, 0.3).mid
    assert band.mid == pytest.approx(0.46 - 0.05 * mid_loss)
    assert band.low < band.mid < band.high
    assert project_hellaswag(pairs[:2], project_final_loss(3.4, 0.3)) is None  # too few evals to draw a line


def _records(losses_at: dict[int, float], hellaswag: dict[int, float] | None = None) -> list[dict]:
    records = [{"step": s, "val_loss": v} for s, v in losses_at.items()]
    return records + [{"step": s, "hellaswag_acc_norm": a} for s, a in (hellaswag or {}).items()]


def test_a_stable_phase_loss_far_above_target_can_still_be_on_track():
    """3.40 at the stable phase's end is 0.11 above GPT-2's 3.29, and still on track: the decay takes ~4% off."""
    end = stable_phase_end(RECIPE)
    found = project(_records({1000: 3.9, 4000: 3.6, end: 3.40}), RECIPE, end, end)
    assert found.final_loss.high < GPT2_124M_VAL_LOSS and found.verdict == "on track" and found.steps_needed is None


def test_a_trailing_run_is_sized_from_its_stable_phase_trend():
    """Loss = 6.2 - 0.3 ln(step) in the stable phase: the run needs the stable loss whose decay reaches the target,
    found along that line."""
    end = stable_phase_end(RECIPE)
    losses = {s: 6.2 - 0.3 * math.log(s) for s in (1000, 2000, 3000, 4000, 5000, 6000, end)}
    assert log_slope(sorted(losses.items())) == pytest.approx(-0.3)
    found = project(_records(losses), RECIPE, end, end)
    assert found.final_loss.low > GPT2_124M_VAL_LOSS and found.verdict == "trails"
    median = sorted(decay_gains())[3]
    stable_needed = GPT2_124M_VAL_LOSS / (1 - median * 0.3)
    expected = math.ceil(end * math.exp((stable_needed - losses[end]) / -0.3) / 0.7)
    assert found.steps_needed == expected
    # --extend to that length: the stable phase's loss carried on to the new stable end projects onto the target
    longer = replace(RECIPE, max_steps=expected)
    again = project(_records(losses), longer, end, stable_phase_end(longer))
    assert again.final_loss.mid == pytest.approx(GPT2_124M_VAL_LOSS, abs=2e-3)


def test_hellaswag_at_chance_early_on_does_not_bend_the_line_through_the_later_evals():
    """acc_norm at chance (0.25) while the loss is high, then acc = 0.66 - 0.12 loss: the projection follows the
    later evals' line, not one flattened by the early ones."""
    end = stable_phase_end(RECIPE)
    steps = [1000, 2000, 3000, 4000, 5000, 6000, 7000]
    losses = dict(zip(steps, [4.6, 4.0, 3.7, 3.6, 3.52, 3.46, 3.42], strict=True))
    acc = {s: 0.25 if s <= 2000 else 0.66 - 0.12 * v for s, v in losses.items()}
    found = project(_records(losses, acc), RECIPE, 7000, end)
    assert found.hellaswag.mid == pytest.approx(0.66 - 0.12 * found.final_loss.mid, abs=1e-6)


def test_the_chain_reads_a_projection_record_in_one_line():
    record = {"step": 9480, "event": "projection", "projected_val_loss": {"low": 3.3, "mid": 3.31, "high": 3.32},
              "projected_hellaswag": None, "verdict": "trails", "steps_needed": 16250}
    assert summary_line(record) == ("projection at the stable phase's end (step 9480): final val loss 3.3100 (3.3000 "
                                    "to 3.3200): trails; lengthen to about 16,250 steps (total_steps, with "
                                    "train.extend)")


def test_no_evals_no_projection():
    assert project([{"step": 5, "loss": 4.0}], RECIPE, 7000, 7000) is None


@pytest.mark.slow
def test_a_wsd_run_logs_its_projection_at_the_stable_phases_end_and_extend_prints_it_again(demo_data, tmp_path):
    wsd = {"schedule": "wsd", "cooldown_frac": 0.4, "lr": 3e-3, "eval_every": 1, "eval_batches": 2}
    cfg = small_config(demo_data, tmp_path / "run", max_steps=10, **wsd)
    end = stable_phase_end(cfg)
    _, lines = train_in_process(cfg)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    (logged,) = [r for r in records if r.get("event") == "projection"]
    expected = project([r for r in records if r["step"] <= end and r.get("event") != "projection"], cfg, end, end)
    assert logged["step"] == end and logged["projected_val_loss"]["mid"] == pytest.approx(expected.final_loss.mid)
    assert logged["verdict"] == expected.verdict == "trails"  # a tiny model far above GPT-2's loss
    assert any(line.startswith(f"projection from the stable phase (step {end}, ") for line in lines)
    assert any(line.startswith("recommendation: trails") for line in lines)
    _, lines = train_in_process(replace(cfg, max_steps=20, extend=True, stop_after_steps=1))
    assert any(line.startswith(f"projection from the stable phase (step {end}, ") for line in lines)
