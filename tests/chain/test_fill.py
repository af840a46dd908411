"""fill_session: after --smoke measured the machine, the run is sized to fill that share of one session (evals
included), up to one pass of the tokens its tokenize parts make, and the parts make no more than it reads; without
a measurement total_steps stays; a chain fixes the figure at its first start."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from helpers import REPO, example_config, run_script

from scripts.chain.config import load_config
from scripts.chain.fill import apply_fill, fixed_fill, session_fill
from scripts.chain.plan import make_plan
from scripts.chain.state import State
from shared.errors import UserError

BATCH = 524_288  # gpt2-124m's tokens a step


def measured(tmp_path, tokens_per_s: float):
    path = tmp_path / f"measured-{tokens_per_s:g}.json"
    path.write_text(json.dumps([{"accelerator": "TpuV5E8", "preset": "gpt2", "seq_len": 1024,
                                 "tokens_per_s": tokens_per_s, "chain": "smoke"}]))
    return path


def gpt2_124m(fill: float = 0.85):
    return load_config(REPO / "examples" / "chain-gpt2-124m.json", overrides={"fill_session": fill})


def muon(**overrides):
    return load_config(REPO / "examples" / "chain-gpt2-124m-muon.json", overrides=overrides)


def test_a_measured_machine_fills_the_share_of_the_session_it_is_given(tmp_path):
    cfg = gpt2_124m()
    fill = session_fill(cfg, measured(tmp_path, 250_000), now=0)
    share = make_plan(cfg, measured_path=measured(tmp_path, 250_000))["eval_share"]
    # 85% of 9 h is 7.65 h (within the 8.30 h of training the margins leave), evals included, less the checkpoint
    # writes in it: room for the final one (1.5 writes of 34.9 s, and 2 steps of 2.12 s) and 12 every 1,000 steps.
    write_s, step_s = 5 + 12 * 124_475_904 / 50e6, BATCH * (1 + share) / 250_000
    train_s = 0.85 * 32400 - 1.5 * write_s - 2 * step_s - 12 * write_s
    assert fill.total_steps == math.floor(train_s * 250_000 / (1 + share) / BATCH) == 12_787
    assert fill.tokens == fill.total_steps * BATCH
    # The two parts make no more than the run reads and the validation shard, in whole shards.
    assert fill.tokens_per_part == math.ceil((fill.tokens + 100_000_000) / 2 / 100_000_000) * 100_000_000
    assert fill.line.startswith("fill_session: total_steps 12787 (6.70B tokens, 85% of a 9-h session) at the "
                                "250,000 tokens/s measured by --smoke: 7.52 h of training, evals included, ending ")
    filled = apply_fill(cfg, fill)
    assert filled.total_steps == 12_787 and filled.tokenize.settings["tokens_per_part"] == fill.tokens_per_part
    plan = make_plan(filled, measured_path=measured(tmp_path, 250_000))
    assert plan["sessions"] == 1 and plan["tokenized_tokens"] >= fill.tokens + plan["validation_tokens"]


def test_a_fast_machine_is_capped_at_one_pass_of_the_tokenized_data(tmp_path):
    fill = session_fill(gpt2_124m(), measured(tmp_path, 2_000_000), now=0)
    # FineWeb-Edu sample-10BT: 10B tokens in the two parts, the first shard of 100M for validation.
    assert fill.total_steps == (10_000_000_000 - 100_000_000) // BATCH == 18_882
    assert "(9.90B tokens, one pass of the tokens the tokenize parts make) at the 2,000,000 tokens/s" in fill.line
    assert fill.tokens_per_part == 5_000_000_000  # two parts of 5B hold the 10B corpus


def test_without_a_measurement_or_with_fill_off_total_steps_stays(tmp_path):
    assert session_fill(gpt2_124m(), tmp_path / "none.json") is None
    assert session_fill(gpt2_124m(0.0), measured(tmp_path, 250_000)) is None
    assert apply_fill(gpt2_124m(), None).total_steps == 19_073
    with pytest.raises(UserError, match=r"fill_session must be a share of the session between 0 \(off\) and 1, got 85"):
        gpt2_124m(85)


def test_a_chain_keeps_the_fill_of_its_first_start_whatever_is_measured_later(tmp_path, monkeypatch):
    from scripts.chain import fill as fill_module

    state = State(tmp_path / "state.json")
    lines = []
    monkeypatch.setattr(fill_module, "session_fill", lambda cfg: session_fill(cfg, measured(tmp_path, 250_000)))
    first = fixed_fill(gpt2_124m(), state, lines.append)
    monkeypatch.setattr(fill_module, "session_fill", lambda cfg: session_fill(cfg, measured(tmp_path, 400_000)))
    again = fixed_fill(gpt2_124m(), State(tmp_path / "state.json"), lines.append)
    assert first.total_steps == again.total_steps == 12_787
    assert dataclasses.asdict(first) == dataclasses.asdict(again)
    assert lines[1] == ("fill_session: total_steps 12787 (6.70B tokens, 85% of a 9-h session), as fixed at this "
                        "chain's first start")
    monkeypatch.setattr(fill_module, "session_fill", lambda cfg: None)
    lines.clear()
    assert fixed_fill(gpt2_124m(), State(tmp_path / "other.json"), lines.append).total_steps == 19_073
    assert lines == ["fill_session: no --smoke measurement on TpuV5E8 for this preset and sequence length; "
                     "total_steps stays 19073"]


def test_the_muon_example_trains_over_12b_tokens_in_its_one_session_at_500k_tokens_a_second(tmp_path):
    cfg = muon(plan_tokens_per_s=500_000)
    assert cfg.fill_session >= 0.8 and cfg.fill_passes == 2
    fill = session_fill(cfg, tmp_path / "none.json", now=0)
    share = make_plan(cfg, measured_path=tmp_path / "none.json")["eval_share"]
    # 85% of 9 h, less the checkpoint writes in it (as above): the final one's room and one every 1,000 steps, 25.
    write_s, step_s = 5 + 12 * 124_475_904 / 50e6, BATCH * (1 + share) / 500_000
    train_s = 0.85 * 32400 - 1.5 * write_s - 2 * step_s - 25 * write_s
    assert fill.total_steps == math.floor(train_s * 500_000 / (1 + share) / BATCH) == 25_148
    assert fill.tokens >= 12e9
    # sample-10BT whole in two parts of 5.0B: 9.9B training tokens (the first 100M shard is validation), read 1.33
    # times; the parts stay whole (tokens_per_part 0: unchanged)
    assert fill.tokens_per_part == 0
    assert "(13.18B tokens, 85% of a 9-h session; 1.33 passes over the 9.90B training tokens the tokenize parts " \
           "make) at the 500,000 tokens/s plan_tokens_per_s" in fill.line
    plan = make_plan(apply_fill(cfg, fill), measured_path=tmp_path / "none.json")
    assert plan["sessions"] == 1 and plan["train_tokens"] == fill.tokens
    assert plan["tokenized_tokens"] == 10_000_000_000 and plan["validation_tokens"] == 100_000_000
    # `--plan` at that rate says the same: the fill's line, then the plan of the filled run, one session.
    config = tmp_path / "muon-500k.json"
    raw = example_config("chain-gpt2-124m-muon.json")
    config.write_text(json.dumps({**raw, "plan_tokens_per_s": 500_000}))
    proc = run_script("scripts/chain_sessions.py", "--config", str(config), "--plan", timeout=120,
                      env={"KAGGLE_CONFIG_DIR": str(tmp_path), "KAGGLE_USERNAME": "", "KAGGLE_KEY": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("fill_session: total_steps 25148 (13.18B tokens")
    (train_line,) = [line for line in proc.stdout.splitlines() if line.startswith("train     ")]
    assert "25,148 steps x 524,288 tokens = 13.18B tokens" in train_line
    assert "13.18B tokens take" in proc.stdout and "1 session(s)" in proc.stdout
    assert "the run repeats data (1.33 passes over the training shards)" in proc.stdout
    (tokenize_line,) = [line for line in proc.stdout.splitlines() if line.startswith("tokenize  ")]
    assert "2 part(s) x 5.00B tokens = 10.00B tokens of HuggingFaceFW/fineweb-edu sample-10BT" in tokenize_line
    assert "(10.0 GB a part, 19 GB allowed; notebook outputs, not datasets, so not counted in the storage line" \
           in tokenize_line


def test_fill_passes_caps_a_fast_machine_at_two_passes_and_a_slow_one_reads_each_token_once(tmp_path):
    fast = session_fill(muon(plan_tokens_per_s=950_000), tmp_path / "none.json", now=0)
    assert fast.total_steps == 2 * 9_900_000_000 // BATCH == 37_765
    assert "(19.80B tokens, 2 passes of the tokens the tokenize parts make) at the 950,000 tokens/s" in fast.line
    slow = session_fill(muon(plan_tokens_per_s=250_000), tmp_path / "none.json", now=0)
    assert slow.tokens < 9.9e9 and "passes" not in slow.line
    # the parts then make what the run reads and the validation shard, no more
    assert slow.tokens_per_part == math.ceil((slow.tokens + 100_000_000) / 2 / 100_000_000) * 100_000_000
    with pytest.raises(UserError, match=r"fill_passes must be between 1 and 4 passes over the tokenized data"):
        muon(fill_passes=5)
