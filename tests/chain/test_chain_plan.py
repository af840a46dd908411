"""The chain's config is checked at load by the kernels' own settings classes, and `--plan` says what a config
will do before anything is pushed (issue 18)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
from helpers import REPO, error_lines, example_config, run_script, train_config

from scripts.chain.config import config_from_dict, load_config
from scripts.chain.limits import session_devices
from scripts.chain.plan import PLAN_MFU, make_plan, plan_lines, planned_train, print_plan
from scripts.chain.sizing import training_s
from shared.config import EvalConfig, TokenizeConfig, TrainConfig
from shared.errors import UserError
from shared.flags import parse_dataclass
from shared.model_shape import ModelConfig

ISSUE_BAD_CONFIG = {"train": {"preset": "gpt2", "micro_batch": 33, "total_batch_tokens": 1000, "lr": -1},
                    "tokenize": {"parts": 1}}
EXAMPLES = sorted((REPO / "examples").glob("chain-*.json"))


def _with_train(**train) -> dict:
    return {**ISSUE_BAD_CONFIG, "train": {"preset": "gpt2", **train}}


def test_the_issues_bad_config_is_refused_one_setting_at_a_time():
    with pytest.raises(UserError, match=r"^config: train: --lr must be positive, got -1.0$"):
        config_from_dict(ISSUE_BAD_CONFIG)
    with pytest.raises(UserError, match=r"--total-batch-tokens 1000 is not a multiple of micro-batch x seq-len = "
                                        r"33 x 1024 = 33792"):
        config_from_dict(_with_train(micro_batch=33, total_batch_tokens=1000))
    with pytest.raises(UserError, match=r"--micro-batch 33 must be a multiple of the 8 devices"):
        config_from_dict(_with_train(micro_batch=33, total_batch_tokens=33 * 1024 * 4))


def test_plan_refuses_the_issues_bad_config_in_one_line_and_pushes_nothing(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(ISSUE_BAD_CONFIG))
    proc = run_script("scripts/chain_sessions.py", "--config", str(path), "--plan", timeout=120,
                      env={"KAGGLE_CONFIG_DIR": str(tmp_path / "no-credentials")})
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [f"error: {path}: train: --lr must be positive, got -1.0"]
    assert "plan for chain" not in proc.stdout


def test_the_micro_batch_is_split_over_the_target_machines_devices():
    assert [session_devices(s) for s in ("TpuV5E8", "TpuV6E8", "TpuV38", "", "NvidiaTeslaT4")] == [8, 8, 8, 8, 1]
    assert session_devices("TpuV5E8", backend="cpu") == 1
    twelve = {"tokenize": {"parts": 1}, "train": {"preset": "gpt2", "micro_batch": 12,
                                                  "total_batch_tokens": 12 * 1024 * 2}}
    with pytest.raises(UserError, match="--micro-batch 12 must be a multiple of the 8 devices"):
        config_from_dict({**twelve, "accelerator": "TpuV6E8"})
    assert config_from_dict({**twelve, "accelerator": "NvidiaTeslaT4"}).train.settings["micro_batch"] == 12


@pytest.mark.parametrize("section, settings, message", [
    ("train", {"lr": "3e-4"}, "train: --lr: expected a number, got '3e-4'"),
    ("train", {"micro_batch": 32.5}, "train: --micro-batch: expected a whole number or auto, got 32.5"),
    ("train", {"grad_clip": -1}, "train: --grad-clip must be >= 0, got -1.0"),
    ("train", {"schedule": "linear"}, "train: --schedule must be cosine or wsd, got 'linear'"),
    ("train", {"muon_momentum": 1.0}, r"train: --muon-momentum must be in \[0, 1\), got 1.0"),
    ("tokenize", {"shard_size": 0}, "tokenize.settings: --shard-size must be positive, got 0"),
    ("tokenize", {"tokens_per_part": "9.4e9"}, "tokenize.settings: --tokens-per-part: expected int"),
    ("eval", {"hellaswag_batch": 0}, "eval.settings: --hellaswag-batch must be positive, got 0"),
    ("eval", {"kaggle_model": "me/gpt2"}, "eval.settings: --kaggle-model 'me/gpt2': expected owner/model/"),
])
def test_every_stages_settings_are_checked_at_load(section, settings, message):
    raw = {"tokenize": {"parts": 1}, "train": {"preset": "gpt2", "micro_batch": 32}}
    if section == "train":
        raw["train"] = {**raw["train"], **settings}
    else:
        raw[section] = {**raw.get(section, {}), "settings": settings}
    with pytest.raises(UserError, match=f"^config: {message}"):
        config_from_dict(raw)


def test_a_kernel_refuses_a_setting_with_the_words_the_chain_uses():
    with pytest.raises(UserError) as chain_err:
        config_from_dict({"tokenize": {"parts": 1}, "train": {"warmup_steps": -5}})
    with pytest.raises(UserError) as kernel_err:
        parse_dataclass(TrainConfig, [], defaults={"warmup_steps": -5})
    assert str(kernel_err.value) == "--warmup-steps must be >= 0, got -5"
    assert str(chain_err.value) == f"config: train: {kernel_err.value}"
    with pytest.raises(UserError, match="--max-output-gb 0.0001 is smaller than one shard"):
        parse_dataclass(TokenizeConfig, ["--max-output-gb", "0.0001"])
    with pytest.raises(UserError, match="--top-k must be >= 0"):
        EvalConfig(top_k=-1)


def test_a_config_changed_after_it_was_built_is_checked_again():
    cfg = TrainConfig()
    cfg.optim.lr = 0.0
    with pytest.raises(UserError, match="--lr must be positive"):
        cfg.validate(8)


def test_flops_per_token_counts_the_real_models_parameters():
    import torch

    from shared.model.model import GPT
    from shared.model_shape import MODEL_PRESETS

    with torch.device("meta"):
        model = GPT(MODEL_PRESETS["gpt2"])
    n = sum(p.numel() for p in model.parameters())
    assert MODEL_PRESETS["gpt2"].num_params() == n == 124_475_904
    assert MODEL_PRESETS["gpt2"].flops_per_token() == 6 * n + 12 * 12 * 768 * 1024 == 860_101_632
    assert ModelConfig(n_layer=2, n_head=4, n_embd=128, block_size=256).flops_per_token() > 0


def _no_measurement(tmp_path: Path) -> Path:
    return tmp_path / "none.json"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_plan_of_every_example_config_counts_its_sessions_and_tpu_hours(example, tmp_path):
    from scripts.chain.plan import planned_train

    cfg = load_config(example)
    lines: list[str] = []
    plan = print_plan(cfg, log=lines.append, with_quota=False, measured_path=_no_measurement(tmp_path))
    assert plan["kernels_built"] == cfg.tokenize.parts + 2  # every kernel built and checked
    train, _ = planned_train(cfg)
    # The estimate: 30% of a v5e-8's 8 x 197 TFLOP/s over the model's FLOPs per token (docs/tpu-throughput.md
    # section 2 lists 549,702 tokens/s for gpt2 at 30%).
    rate = 8 * 197e12 * PLAN_MFU / train.model.shape.flops_per_token()
    assert plan["tokens_per_s"] == pytest.approx(rate)
    if train.model.preset == "gpt2":
        assert round(plan["tokens_per_s"]) == 549_702
    train_s = cfg.total_steps * train.step.total_batch_tokens / rate * (1 + plan["eval_share"])
    # A session trains its budget less its checkpoint writes (scripts/chain/sizing.py training_s).
    session_s = training_s(cfg.time_budget, train, rate, plan["eval_share"])
    assert plan["session_seconds"] == pytest.approx(session_s) and session_s < cfg.time_budget
    sessions = min(math.ceil(train_s / session_s), cfg.max_train_sessions or 10**9)
    assert plan["sessions"] == sessions
    margins = sessions * (cfg.startup_margin_s + cfg.publish_margin_s)
    assert plan["train_quota_s"] == pytest.approx(min(train_s * cfg.time_budget / session_s,
                                                      sessions * cfg.time_budget) + margins)
    assert any(f"{sessions} session(s)" in line for line in lines)
    assert any(line.startswith(f"TPU hours   ~{plan['quota_s'] / 3600:.2f} h") for line in lines)
    # The command a user runs exits 0 and prints the same sessions and hours (from the same measured figures).
    proc = run_script("scripts/chain_sessions.py", "--config", str(example), "--plan", timeout=120,
                      env={"KAGGLE_CONFIG_DIR": str(tmp_path), "KAGGLE_USERNAME": "", "KAGGLE_KEY": ""})
    assert proc.returncode == 0, proc.stderr
    expected = []
    print_plan(cfg, log=expected.append, with_quota=False)
    counted = [line for line in expected if line.startswith(("            ", "TPU hours"))]
    assert counted and all(line in proc.stdout.splitlines() for line in counted), (counted, proc.stdout)


def test_plan_of_the_gpt2_examples_fits_one_session_and_one_week(tmp_path):
    for name, sessions in (("chain-gpt2-124m.json", 1), ("chain-gpt2-124m-muon.json", 1),
                           ("chain-gpt2-124m-stretch.json", 2)):
        plan = make_plan(load_config(REPO / "examples" / name), measured_path=_no_measurement(tmp_path))
        assert (plan["sessions"], plan["sessions_per_week"], plan["weeks"]) == (sessions, 2, 1)
        assert plan["quota_s"] <= plan["weekly_quota_s"]
        assert plan["checkpoint_bytes"] == 12 * 124_475_904
    # FineWeb-Edu's sample-10BT holds about 10B tokens: the AdamW run reads it once (and 1% again, as llm.c's does),
    # the Muon run (unmeasured: 7.0B tokens) reads sample-10BT's two parts once, less 29%, the stretch run makes three
    # passes over the AdamW run's parts.
    passes = {}
    for name in ("chain-gpt2-124m.json", "chain-gpt2-124m-muon.json", "chain-gpt2-124m-stretch.json"):
        plan = make_plan(load_config(REPO / "examples" / name), measured_path=_no_measurement(tmp_path))
        passes[name] = plan["train_tokens"] / (plan["tokenized_tokens"] - plan["validation_tokens"])
    assert passes == pytest.approx({"chain-gpt2-124m.json": 10_000_000_000 / 9.9e9,
                                    "chain-gpt2-124m-muon.json": 13_352 * 524_288 / 9.9e9,
                                    "chain-gpt2-124m-stretch.json": 57_221 * 524_288 / 9.9e9}, rel=1e-3)


def test_the_muon_recipe_is_sized_for_hellaswag_7b_tokens_in_one_v5e_session_at_its_stated_rate(tmp_path):
    cfg = load_config(REPO / "examples" / "chain-gpt2-124m-muon.json")
    lines: list[str] = []
    plan = print_plan(cfg, log=lines.append, with_quota=False, measured_path=_no_measurement(tmp_path))
    assert cfg.accelerator == "TpuV5E8" and plan["sessions"] == 1
    assert plan["train_tokens"] >= 6.5e9 and plan["train_tokens"] == 13_352 * 524_288
    # The rate it needs for one session: its tokens (with the evals' share) over the session's training time, its
    # budget less its checkpoint writes (fewer at a slower rate: the rate that just fits, found by iterating).
    train, _ = planned_train(cfg)
    needed = plan["tokens_per_s"]
    for _ in range(5):
        needed = plan["train_tokens"] * (1 + plan["eval_share"]) / training_s(cfg.time_budget, train, needed,
                                                                             plan["eval_share"])
    assert needed == pytest.approx(240_500, rel=0.01) and needed < plan["tokens_per_s"]
    (train_line,) = [line for line in lines if line.startswith("train     ")]
    assert "13,352 steps x 524,288 tokens = 7.00B tokens" in train_line
    assert any("every 1000, at the stable phase's end and at the last step: HellaSwag on all 10,042 examples"
               in line for line in lines)


def test_plan_counts_with_the_newest_smoke_measurement_on_that_machine(tmp_path):
    cfg = load_config(REPO / "examples" / "chain-gpt2-124m.json")
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps([
        {"accelerator": "TpuV5E8", "preset": "gpt2", "seq_len": 1024, "tokens_per_s": 300_000.0, "chain": "a"},
        {"accelerator": "TpuV6E8", "preset": "gpt2", "seq_len": 1024, "tokens_per_s": 2_000_000.0, "chain": "b"},
        {"accelerator": "TpuV5E8", "preset": "gpt2", "seq_len": 1024, "tokens_per_s": 250_000.0, "chain": "c",
         "mfu": 0.136},
    ]))
    plan = make_plan(cfg, measured_path=measured)
    assert plan["tokens_per_s"] == 250_000.0 and plan["tokens_per_s_source"].startswith("measured by --smoke (c")
    # 10.0B tokens at 250K tokens/s: 11.1 h of training, two 8.5-h sessions
    assert plan["sessions"] == 2
    assert make_plan(dataclasses.replace(cfg, plan_tokens_per_s=1e6), measured_path=measured)["tokens_per_s"] == 1e6


def test_plan_warns_when_the_tokenize_parts_are_shorter_than_training(tmp_path):
    raw = example_config("chain-gpt2-124m.json")
    raw["tokenize"] = {"parts": 1, "settings": {"tokens_per_part": 4_000_000_000}}
    cfg = config_from_dict({k: v for k, v in raw.items() if not k.startswith("_")})
    lines = plan_lines(cfg, make_plan(cfg, measured_path=_no_measurement(tmp_path)))
    assert ("warning     the parts make 4.00B tokens but training reads 10.00B: the run repeats data (2.56 passes "
            "over the training shards)") in lines
    assert any(line.startswith("margin      tokens: 4.00B tokenized for 10.00B trained + 0.10B validation: -60.4%")
               for line in lines)


def test_plan_with_credentials_shows_the_accounts_quota(local_kaggle, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "chain_sessions.py"), "--config",
                           str(REPO / "examples" / "chain-gpt2-124m.json"), "--plan"], env=local_kaggle.env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    # the local Kaggle's 20 h TPU quota, none used this week
    assert any(line.startswith("quota       20.00 h left this week of 20.00 h (your account)") for line in lines)
    assert "quota not read" not in proc.stdout
    assert lines[-1].startswith("4 kernel(s) built and checked")  # two tokenize parts, train, eval


def test_plan_counts_sessions_against_the_quota_left_this_week(tmp_path):
    """The stretch run's two 9-h sessions: with 20 h left both start this week; with 10 h one does and the other
    waits for the reset; with 5 h none starts before it."""
    cfg = load_config(REPO / "examples" / "chain-gpt2-124m-stretch.json")
    measured = _no_measurement(tmp_path)
    hour, week = 3600.0, 20 * 3600.0
    for left, this_week, weeks in ((20 * hour, 2, 1), (10 * hour, 1, 2), (5 * hour, 0, 2)):
        plan = make_plan(cfg, quota=(left, week, "reset"), measured_path=measured)
        assert plan["sessions"] == 2 and plan["sessions_per_week"] == 2
        assert (plan["sessions_this_week"], plan["weeks"]) == (this_week, weeks), left
        lines = plan_lines(cfg, plan)
        spare = left + week * (weeks - 1) - plan["quota_s"]
        assert any(line.startswith(f"margin      quota: {spare / 3600:.2f} h spare over {weeks} week(s)")
                   for line in lines), lines
        assert any(line.startswith(f"quota       {left / 3600:.2f} h left this week of 20.00 h (your account): "
                                   f"{this_week} this week, 2 session(s) a week") for line in lines)
        assert any("less than one 9.00 h session" in line for line in lines) == (this_week == 0)


def test_plan_without_credentials_still_prints_the_plan(tmp_path):
    proc = run_script("scripts/chain_sessions.py", "--config", "examples/chain-gpt2-124m.json", "--plan",
                      timeout=120, env={"KAGGLE_CONFIG_DIR": str(tmp_path), "KAGGLE_USERNAME": "", "KAGGLE_KEY": ""})
    assert proc.returncode == 0, proc.stderr
    assert "quota       20.00 h a week (Kaggle's stated quota, not verified" in proc.stdout
    assert "(quota not read: " in proc.stdout


def test_plan_with_smoke_plans_the_smoke_chain_and_with_the_local_demo_starts_nothing(tmp_path):
    env = {"KAGGLE_CONFIG_DIR": str(tmp_path), "KAGGLE_USERNAME": "", "KAGGLE_KEY": ""}
    proc = run_script("scripts/chain_sessions.py", "--config", "examples/chain-gpt2-124m.json", "--smoke", "--plan",
                      timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("plan for chain gpt2-124m-smoke (examples/chain-gpt2-124m.json): nothing is pushed")
    assert "2 session(s) (max_train_sessions)" in proc.stdout and "a session of at most 0.49 h" in proc.stdout
    demo = run_script("scripts/chain_sessions.py", "--local-demo", "--plan", "--workdir", str(tmp_path / "demo"),
                      timeout=120, env=env)
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.startswith("plan for chain gpt2-demo (") and "local Kaggle" not in demo.stdout
    assert ("sessions    each its start-up as measured (~90 s) + 30 s of training (session_train_s) from the end "
            "of its first step + 20 s to publish, at most 0.08 h; the first 10 steps\n") in demo.stdout
    assert not (tmp_path / "demo").exists()  # no local Kaggle was started, nothing pushed


def test_the_chain_configs_own_fields_are_type_checked():
    with pytest.raises(UserError, match=r"^config: total_steps: expected int, got '19073'$"):
        config_from_dict({"total_steps": "19073", "token_datasets": ["a/b"]})
    assert config_from_dict({"session_limit_s": 32400, "token_datasets": ["a/b"]}).session_limit_s == 32400.0
    with pytest.raises(UserError, match="hellaswag 'hs.jsonl' is not download, demo or an existing jsonl file"):
        config_from_dict({"hellaswag": "hs.jsonl", "token_datasets": ["a/b"]})


def test_micro_batch_auto_is_resolved_for_the_chains_tpu():
    from scripts.chain.plan import planned_train
    from shared.tpu import micro_batch_for

    cfg = load_config(REPO / "examples" / "chain-gpt2-124m.json")
    assert cfg.train.settings["micro_batch"] == "auto"
    train, note = planned_train(cfg)
    # docs/tpu-throughput.md's compiled v5e-8 rows: flash at 128 (11.4 GiB a chip), SDPA at 64 (9.9 GiB); splash, which
    # a session tries first, is sized as flash is (no T x T in HBM either), so only SDPA's differs.
    assert (train.step.micro_batch, train.grad_accum_steps) == (128, 4)
    assert note == "auto: 128 on v5e with pallas-splash attention, 64 if it falls back to SDPA"
    v6e = config_from_dict({**{k: v for k, v in example_config("chain-gpt2-124m.json")
                               .items() if not k.startswith("_")}, "accelerator": "TpuV6E8"})
    assert planned_train(v6e)[0].step.micro_batch == 256  # 22.7 GiB a chip (libtpu)
    small = train_config(preset="gpt2", micro_batch="auto", total_batch_tokens=8 * 1024 * 3)
    assert micro_batch_for(small, "v6e", "pallas-flash", 8) == 8  # 24 sequences: only 1 a device divides them
    with pytest.raises(UserError, match="--micro-batch: expected a whole number or auto, got 'lots'"):
        parse_dataclass(TrainConfig, ["--micro-batch", "lots"])
    with pytest.raises(UserError, match="is not a multiple of 8 devices x seq-len 1024 = 8192, so no micro-batch"):
        train_config(preset="gpt2", micro_batch="auto", total_batch_tokens=4096).validate(8)


def test_plan_counts_only_the_tokens_the_corpus_holds(tmp_path):
    raw = example_config("chain-gpt2-124m.json")
    cfg = config_from_dict({k: v for k, v in raw.items() if not k.startswith("_")})
    plan = make_plan(cfg, measured_path=_no_measurement(tmp_path))
    assert (plan["parts"], plan["tokens_per_part"], plan["tokenized_tokens"]) == (2, 9_400_000_000, 10_000_000_000)
    assert "          the corpus holds about 10.00B tokens: the last part ends where it does" in plan_lines(cfg, plan)
    local = {**raw["tokenize"], "settings": {"data_files": "/data/*.jsonl"}}
    plan = make_plan(config_from_dict({**{k: v for k, v in raw.items() if not k.startswith("_")}, "tokenize": local}),
                     measured_path=_no_measurement(tmp_path))
    assert plan["tokenized_tokens"] == 2 * 9_400_000_000  # local files: their size is not known, the parts are counted


def test_a_tokenize_part_that_would_start_past_the_corpus_end_is_refused():
    raw = example_config("chain-gpt2-124m.json")
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    with pytest.raises(UserError, match=r"^config: tokenize.parts 3 x 9.4B tokens: HuggingFaceFW/fineweb-edu "
                                        r"sample-10BT holds about 10B, so part 2 would start past its end; use at "
                                        r"most 2 part\(s\)"):
        config_from_dict({**raw, "tokenize": {"parts": 3}})
    assert config_from_dict({**raw, "tokenize": {"parts": 11, "settings": {"config": "sample-100BT"}}})
    assert config_from_dict({**raw, "tokenize": {"parts": 2}})


def test_plan_of_a_wsd_run_counts_the_stable_phase_checkpoint_and_says_what_extend_does(tmp_path):
    raw = example_config("chain-gpt2-124m-muon.json")
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    for extend in (False, True):
        cfg = config_from_dict({**raw, "train": {**raw["train"], "extend": extend}})
        lines: list[str] = []
        print_plan(cfg, log=lines.append, with_quota=False, measured_path=_no_measurement(tmp_path))
        stages = [line.split(":")[0] for line in lines if line.split(" ")[0] in ("tokenize", "train", "eval")]
        assert stages == ["tokenize  CPU, internet on", "train     TpuV5E8, 8 devices", "eval      TpuV5E8"]
        (checkpoint,) = [line for line in lines if line.startswith("checkpoint  ")]
        assert checkpoint.endswith("and from the end of the stable phase the checkpoint kept there beside it "
                                   "(train.extend trains on from it): 3.0 GB a version)")
        (session,) = [line for line in lines if line.startswith("margin      session: ")]
        assert f"the upload alone ~{2 * cfg.checkpoint_bytes / 10e6:.0f} s" in session  # both checkpoints, once
        said = [line for line in lines if "train.extend: a finished or decaying run trains on" in line]
        assert len(said) == int(extend)


def test_plan_of_a_model_whose_checkpoints_live_in_temp_keeps_k_versions_and_says_the_session_verifies(tmp_path):
    raw = example_config("chain-gpt2-124m.json")
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    cfg = config_from_dict({**raw, "train": {**raw["train"], "preset": "gpt2-xl", "fsdp": True}, "publish_margin_s": 0})
    lines: list[str] = []
    print_plan(cfg, log=lines.append, with_quota=False, measured_path=_no_measurement(tmp_path))
    (checkpoint,) = [line for line in lines if line.startswith("checkpoint  ")]
    midway_h = (cfg.session_limit_s - cfg.publish_margin_s) / 2 / 3600
    assert checkpoint.endswith("(at most 2 versions kept in each; with no copy in the output, a session waits up to "
                               "600 s for its version and publishes again if it failed; each session also publishes "
                               f"its first checkpoint past {midway_h:.2f} h in, while it trains, for a kill before "
                               "its end)")
    assert 3.5 < midway_h < 4.5  # half of 9 h less the publish margin gpt2-xl's 18.7 GB need
    assert "1 kept in {temp}/checkpoints (not in the session's output, which holds 20 GB)" in checkpoint


def _report(attention: str, micro_batch: int, peak_gib: float, fits: bool = True) -> dict:
    return {"attention": attention, "micro_batch": micro_batch, "peak_bytes": peak_gib * 2**30, "hbm_bytes": 16 * 2**30,
            "fits": fits, "free_fraction": 1 - peak_gib / 16, "versions": {"libtpu": "0.0.17"}, "preset": "gpt2",
            "collectives": [{"kind": "all-reduce", "where": "inside", "count": 4, "bytes": 234.9e6}],
            "mfu_ceiling": 0.543 if attention != "sdpa" else 0.33}


@pytest.mark.parametrize("micro_batch, flash, sdpa, says", [
    ("auto", _report("pallas-flash", 128, 11.0), _report("sdpa", 64, 9.9),
     "if the splash probe fails, flash at micro-batch 128: 11.0 GiB, MFU ceiling 54.3%; if the flash probe fails, "
     "SDPA at micro-batch 64: 9.9 GiB, MFU ceiling 33.0%"),
    (128, _report("pallas-flash", 128, 11.0), _report("sdpa", 128, 18.2, fits=False),
     "if the splash probe fails, flash at micro-batch 128: 11.0 GiB, MFU ceiling 54.3%; if the flash probe fails, "
     "SDPA at micro-batch 128: 18.2 GiB - does not fit: such a session would stop at its first step (leave "
     "train.micro_batch auto)"),
    (256, _report("pallas-flash", 256, 16.5, fits=False), _report("sdpa", 256, 30.0, fits=False),
     "if the splash probe fails, flash at micro-batch 256: 16.5 GiB - does not fit: such a session would stop at its "
     "first step (leave train.micro_batch auto); if the flash probe fails, SDPA at micro-batch 256: 30.0 GiB - does "
     "not fit: such a session would stop at its first step (leave train.micro_batch auto)"),
])
def test_plan_compiles_the_splash_step_and_says_what_the_flash_and_sdpa_fallbacks_need(monkeypatch, micro_batch,
                                                                                       flash, sdpa, says):
    import scripts.tpu_compile_step as tpu_compile
    from scripts.chain.plan import compiled_fit

    asked = []
    primary = _report("pallas-splash", flash["micro_batch"], 7.8)

    def compile_step(settings, tpu, log, attention="flash"):
        asked.append((settings["micro_batch"], tpu, attention))
        return {"splash": primary, "flash": flash, "sdpa": sdpa}[attention]

    monkeypatch.setattr(tpu_compile, "compile_step", compile_step)
    monkeypatch.setattr(tpu_compile, "compiler_python", lambda: Path("/venv-tpu/bin/python"))
    raw = example_config("chain-gpt2-124m.json")
    cfg = config_from_dict({**{k: v for k, v in raw.items() if not k.startswith("_")},
                            "train": {**raw["train"], "micro_batch": micro_batch}})
    report, line = compiled_fit(cfg)
    assert asked == [(micro_batch, "v5e-8", "splash"), (micro_batch, "v5e-8", "flash"), (micro_batch, "v5e-8", "sdpa")]
    assert report is primary
    assert line == (f"v5e-8 by libtpu 0.0.17 (the splash step, micro-batch {flash['micro_batch']}): HBM per "
                    "chip 7.8 GiB of 16 GiB (51% free); all-reduce inside the loop 4, 234.9 MB per micro-step; MFU "
                    "ceiling 54.3%, 50.7% in llm.c's count (roofline estimate); " + says)


def test_with_the_attention_setting_flash_plan_compiles_the_flash_step_first(monkeypatch):
    import scripts.tpu_compile_step as tpu_compile
    from scripts.chain.plan import compiled_fit

    asked = []

    def compile_step(settings, tpu, log, attention="auto"):
        asked.append(attention)
        return _report("sdpa", 64, 9.9) if attention == "sdpa" else _report("pallas-flash", 128, 11.4)

    monkeypatch.setattr(tpu_compile, "compile_step", compile_step)
    monkeypatch.setattr(tpu_compile, "compiler_python", lambda: Path("/venv-tpu/bin/python"))
    raw = example_config("chain-gpt2-124m.json")
    raw["train"]["attention"] = "flash"  # as a session with it set tries flash first
    report, line = compiled_fit(config_from_dict({k: v for k, v in raw.items() if not k.startswith("_")}))
    assert asked == ["flash", "sdpa"] and report["attention"] == "pallas-flash"
    assert line.startswith("v5e-8 by libtpu 0.0.17 (the flash step, micro-batch 128): HBM per chip 11.4 GiB")
    assert line.endswith("; if the flash probe fails, SDPA at micro-batch 64: 9.9 GiB, MFU ceiling 33.0%")


def _demo_config(**train):
    raw = example_config("chain-demo.json")
    return config_from_dict({**{k: v for k, v in raw.items() if not k.startswith("_")},
                             "train": {**raw["train"], **train}})


@pytest.mark.parametrize("seq_len, asked, says", [
    (32, ["sdpa"], "(the SDPA step, what a session runs at T=32: the splash and flash kernels' blocks do not tile it, "
                   "micro-batch 8)"),
    (384, ["splash", "sdpa"], "(the splash step, micro-batch 8)"),  # flash's 256-token dq blocks do not divide 384
    (256, ["splash", "flash", "sdpa"], "(the splash step, micro-batch 8)"),
])
def test_plan_compiles_only_the_steps_a_session_would_run_at_its_sequence_length(monkeypatch, seq_len, asked, says):
    import scripts.tpu_compile_step as tpu_compile
    from scripts.chain.plan import compiled_fit

    kernels = {"splash": "pallas-splash", "flash": "pallas-flash", "sdpa": "sdpa"}
    compiled = []

    def compile_step(settings, tpu, log, attention="auto"):
        compiled.append(attention)
        return {**_report(kernels[attention], 8, 0.2), "preset": "tiny"}

    monkeypatch.setattr(tpu_compile, "compile_step", compile_step)
    monkeypatch.setattr(tpu_compile, "compiler_python", lambda: Path("/venv-tpu/bin/python"))
    report, line = compiled_fit(_demo_config(seq_len=seq_len, total_batch_tokens=8 * seq_len))
    assert compiled == asked and report["attention"] == kernels[asked[0]]
    assert line.startswith(f"v5e-8 by libtpu 0.0.17 {says}: HBM per chip 0.2 GiB of 16 GiB")
    assert line.count("probe fails") == len(asked) - 1


def test_a_fallback_that_does_not_compile_is_one_clause_of_the_line_and_the_plan_goes_on(monkeypatch, tmp_path):
    import scripts.tpu_compile_step as tpu_compile

    def compile_step(settings, tpu, log, attention="auto"):
        if attention == "flash":
            raise TypeError("sub got incompatible shapes for broadcasting: (32, 32), (32, 0).\n(the rest)")
        return _report({"splash": "pallas-splash", "sdpa": "sdpa"}[attention], 128, 7.8)

    monkeypatch.setattr(tpu_compile, "compile_step", compile_step)
    monkeypatch.setattr(tpu_compile, "compiler_python", lambda: Path("/venv-tpu/bin/python"))
    raw = example_config("chain-gpt2-124m.json")
    cfg = config_from_dict({k: v for k, v in raw.items() if not k.startswith("_")})
    lines: list[str] = []
    plan = print_plan(cfg, log=lines.append, with_quota=False, measured_path=_no_measurement(tmp_path))
    (compiled,) = [line for line in lines if line.startswith("compiled    ")]
    assert plan["compiled"]["attention"] == "pallas-splash"
    assert compiled.endswith("; if the splash probe fails, flash: did not compile (TypeError: sub got incompatible "
                             "shapes for broadcasting: (32, 32), (32, 0).); if the flash probe fails, SDPA at "
                             "micro-batch 128: 7.8 GiB, MFU ceiling 33.0%")
    assert lines[-1].startswith("4 kernel(s) built and checked")  # the plan went on to its end


def test_a_primary_step_that_does_not_compile_is_one_line_and_the_arithmetic_checks_hbm(monkeypatch):
    import scripts.tpu_compile_step as tpu_compile
    from scripts.chain.plan import compiled_fit

    def compile_step(settings, tpu, log, attention="auto"):
        raise UserError("tracing the step failed: RuntimeError: no\nmore")

    monkeypatch.setattr(tpu_compile, "compile_step", compile_step)
    monkeypatch.setattr(tpu_compile, "compiler_python", lambda: Path("/venv-tpu/bin/python"))
    assert compiled_fit(_demo_config()) == (None, "v5e-8: the SDPA step did not compile (tracing the step failed: "
                                                  "RuntimeError: no): HBM checked by arithmetic only")
    raw = example_config("chain-gpt2-124m.json")
    too_big = config_from_dict({**{k: v for k, v in raw.items() if not k.startswith("_")}, "publish_margin_s": 0,
                                "train": {**raw["train"], "preset": "gpt2-large"}})
    with pytest.raises(UserError, match="^the train step cannot fit a v5e chip's HBM: "):
        compiled_fit(too_big)  # the arithmetic still refuses what cannot fit


@pytest.mark.parametrize("preset, shape, fsdp, fits", [
    ("gpt2-large", "TpuV5E8", False, False), ("gpt2-large", "TpuV5E8", True, True),
    ("gpt2-large", "TpuV6E8", False, True), ("gpt2-xl", "TpuV6E8", False, False),
    ("gpt2-medium", "TpuV5E8", False, True),
])
def test_without_the_compiler_a_step_that_cannot_fit_one_sequence_a_chip_is_refused_by_arithmetic(
        monkeypatch, preset, shape, fsdp, fits):
    from scripts.chain.plan import compiled_fit

    monkeypatch.setenv("TPU_COMPILER_PYTHON", "off")
    raw = example_config("chain-gpt2-124m.json")
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    cfg = config_from_dict({**raw, "accelerator": shape, "publish_margin_s": 0,
                            "train": {**raw["train"], "preset": preset, "fsdp": fsdp}})
    if fits:
        assert compiled_fit(cfg) == (None, "the TPU compiler is off (TPU_COMPILER_PYTHON=off): HBM checked by "
                                           "arithmetic only")
        return
    with pytest.raises(UserError) as err:
        compiled_fit(cfg)
    gen = "v5e" if shape == "TpuV5E8" else "v6e"
    assert re.fullmatch(rf"the train step cannot fit a {gen} chip's HBM: \d+\.\d GiB a chip at one sequence per "
                        rf"micro-step \({preset}\), over the \d+\.\d GiB its buffers may use \(arithmetic: "
                        r"shared/tpu.py\); set train.fsdp true.*", str(err.value))


def test_plan_of_gpt2_xl_prints_the_temp_disk_peak_and_the_quota_room_its_other_datasets_leave(tmp_path):
    raw = example_config("chain-gpt2-124m.json")
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    cfg = config_from_dict({**raw, "train": {**raw["train"], "preset": "gpt2-xl", "fsdp": True},
                            "publish_margin_s": 0, "token_datasets": ["me/tokens"]})
    plan = make_plan(cfg, None, _no_measurement(tmp_path))
    lines = plan_lines(cfg, plan)
    (disk,) = [line for line in lines if line.startswith("disk        ")]
    # 1 kept + 1 written, the midway publish's links to a third, and a fetched version (twice while extracted)
    assert disk == ("disk        /kaggle/temp holds at most 74.8 GB at once: 2 checkpoints rotating 37.4 GB, the "
                    "midway publish's links 18.7 GB, a fetched version 18.7 GB (a stale mount; 37.4 GB while its zip "
                    "is extracted); its size on Kaggle is not verified: each session measures its free disk before "
                    "training and drops the midway publish, or stops in one line, where the peak does not fit")
    (room,) = [line for line in lines if line.startswith("quota room  ")]
    assert room.startswith("quota room  your other private datasets were not read (no credentials): the whole 100 GB")
    # Read with credentials: 42 GB of the 100 GB taken leaves room for 3 versions, so 1 is kept, with no midway
    plan["private_datasets"] = {"me/tokens": 12 * 10**9, "me/photos": 30 * 10**9}
    lines = plan_lines(cfg, plan)
    (room,) = [line for line in lines if line.startswith("quota room  ")]
    assert room == ("quota room  2 other private dataset(s) of yours take 42.0 GB, the token datasets 12.0 GB of it "
                    "(ListDatasets' sizes): 58.0 GB of the quota is left, 1.9 GB of it beyond the checkpoint versions "
                    "at their most")
    (storage,) = [line for line in lines if line.startswith("storage     ")]
    assert "56.1 GB of the 100 GB private-dataset quota (dataset_quota_gb; keep_dataset_versions 1, not 2 and no " \
           "midway publish, to fit the quota)" in storage
    (disk,) = [line for line in lines if line.startswith("disk        ")]
    assert disk.startswith("disk        /kaggle/temp holds at most 56.1 GB at once: 2 checkpoints rotating 37.4 GB, "
                           "a fetched version 18.7 GB")
    # One upload a publish (two checkpoint datasets in turn): the margin is 600 s + the 18.7 GB upload at 10 MB/s +
    # the session's 600-s wait for its version, 31 minutes less than a deleting publish's second upload took.
    assert cfg.publish_margin_s == pytest.approx(600 + 18.69e9 / 10e6 + 600, abs=10)
    (session, publish) = [line for line in lines if line.startswith(("margin      session", "margin      publish"))]
    assert (f"{cfg.publish_margin_s:g} s to publish, the upload alone ~1869 s at an assumed 10 MB/s, once: a "
            "deleting publish no longer uploads it again (two checkpoint datasets in turn), ~1869 s less than with "
            "one") in session
    assert publish.startswith("margin      publish: 1 version(s) of 18.69 GB upload in ~1869 s")
