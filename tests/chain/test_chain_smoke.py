"""`scripts/chain_sessions.py --smoke`: the first-contact chain derived from a config, run on the local Kaggle,
and its readiness report (issue 18)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers import REPO, run_script

from scripts.chain.config import config_from_dict, load_config
from scripts.chain.sections import TokenizeSection
from scripts.chain.smoke import (
    SMOKE_TPU_BUDGET_S,
    Row,
    quota_cost_s,
    readiness_rows,
    record_measurement,
    report_lines,
    roofline_row,
    run_smoke,
    smoke_config,
)
from shared.errors import UserError
from shared.model_shape import MODEL_PRESETS
from shared.train.throughput import Throughput


def test_the_smoke_chain_is_a_short_copy_of_the_config_under_its_own_names():
    cfg = load_config(REPO / "examples" / "chain-gpt2-124m.json")
    smoke = smoke_config(cfg)
    assert (smoke.name, smoke.slug("checkpoints"), smoke.slug("train")) == (
        "gpt2-124m-smoke", "gpt2-124m-smoke-checkpoints", "gpt2-124m-smoke-train")
    assert (smoke.max_train_sessions, smoke.max_failed_sessions, smoke.accelerator) == (2, 1, "TpuV5E8")
    # the same model, batch, schedule; each session traces 3 compiled steps (for the readiness report's profile)
    assert smoke.train.settings == {**cfg.train.settings, "profile_steps": 3} and smoke.total_steps == cfg.total_steps
    assert smoke.tokenize.parts == 1
    assert smoke.tokenize.settings == {"tokens_per_part": 50_000_000, "shard_size": 10_000_000}
    assert smoke.eval.settings["kaggle_model"] == "" and smoke.eval.settings["hellaswag_examples"] == 200
    # 30-min sessions: a TPU's 1,310-s start-up, 60 s + 1.49 GB at the assumed 10 MB/s to publish (uploaded once:
    # the two checkpoint datasets are used in turn), 240 s of training
    assert smoke.publish_margin_s == pytest.approx(60 + 12 * 124_475_904 / 10e6)
    assert smoke.session_limit_s == math.ceil(1310 + 60 + 149.371 + 240) == 1760
    assert smoke.time_budget == pytest.approx(1760 - 1310 - smoke.publish_margin_s) and smoke.time_budget >= 240
    assert quota_cost_s(smoke) == 3 * 1760 < SMOKE_TPU_BUDGET_S  # two train sessions and the eval on the TPU
    assert smoke.eval_session_limit_s == 1760  # the smoke's eval is a subset, held to the smoke's limit


def test_the_gpt2_smokes_sessions_train_their_whole_budget_after_up_to_900_s_of_start_up():
    """A TPU's start-up (PJRT, the attention probes up to their 900-s budget, W&B, the baseline eval, the step's
    compile) comes before the budget, which the trainer counts from the end of the first step; the deadline leaves
    the start-up margin for it. So after 900 s of start-up the session still trains its 240 s and publishes."""
    import time

    from scripts.chain.limits import TPU_STARTUP_MARGIN_S, TPU_STARTUP_S
    from shared.runtime.attention_probe import PROBE_BUDGET_S
    from shared.train.trainer import session_clock

    smoke = smoke_config(load_config(REPO / "examples" / "chain-gpt2-124m.json"))
    # The margin covers the probes' whole budget, gpt2's step compile (70-145 s) and the baseline eval.
    assert TPU_STARTUP_S["attention probes"] == PROBE_BUDGET_S and TPU_STARTUP_S["step compile"] >= 145
    default = config_from_dict({"token_datasets": ["a/b"]}).startup_margin_s
    assert smoke.startup_margin_s == default == TPU_STARTUP_MARGIN_S > PROBE_BUDGET_S + 145
    settings = smoke.session_clock(smoke.session_limit_s)
    train = smoke.train.config.replace(**settings)
    for startup in (30.0, 300.0, 600.0, 900.0, PROBE_BUDGET_S + 145 + 145):
        now = time.monotonic()
        timer, clock = session_clock(train.session, None, 124_475_904, now - startup + 30.0, now - startup, None)
        clock.first_step_done(1, now - 1.0, now, 1.0, timer.seconds, lambda record: None, lambda line: None)
        assert clock.stop_at - now == pytest.approx(settings["time_budget"]) and clock.budget_s >= 240, startup
        # Its training and final checkpoint end by the deadline: the publish margin is left whole.
        assert clock.stop_at < clock.session_start + settings["session_deadline"], startup
    assert smoke.session_limit_s - settings["session_deadline"] == pytest.approx(smoke.publish_margin_s)


def test_a_smoke_of_a_larger_model_lengthens_its_sessions_by_the_publish_and_says_what_it_costs(tmp_path):
    """The publish of a larger checkpoint is added to the session, never taken from its training; a smoke that
    costs more than 100 min says so before it starts."""
    for preset, publish in (("gpt2-medium", 60 + 12 * MODEL_PRESETS["gpt2-medium"].num_params() / 10e6),
                            ("gpt2-xl", 60 + 12 * MODEL_PRESETS["gpt2-xl"].num_params() / 10e6 + 600)):
        smoke = smoke_config(config_from_dict({"token_datasets": ["a/b"], "train": {"preset": preset}}))
        assert smoke.publish_margin_s == pytest.approx(publish)
        assert smoke.session_limit_s == math.ceil(1310 + publish + 240) and 240 <= smoke.time_budget < 241
        assert quota_cost_s(smoke) == 3 * smoke.session_limit_s > SMOKE_TPU_BUDGET_S
        said = []

        def no_chain(smoke_cfg, workdir):
            raise LookupError("nothing pushed")

        with pytest.raises(LookupError):
            run_smoke(config_from_dict({"name": preset, "token_datasets": ["a/b"], "train": {"preset": preset}}),
                      tmp_path, no_chain, log=said.append)
        minutes = smoke.session_limit_s / 60
        assert said == [f"smoke run {preset}-smoke: one tokenize part, two train sessions of at most {minutes:.0f} min "
                        f"on TpuV5E8, an eval on a subset (at most {minutes:.0f} min); at most {3 * minutes:.0f} min "
                        "of TPU quota (over the 100 min a first contact should cost: this model's checkpoint takes "
                        "long to publish)"]
    # An explicit smoke.session_limit_s that leaves nothing to train is one line naming the smoke's setting.
    with pytest.raises(UserError) as err:
        smoke_config(config_from_dict({"name": "big", "token_datasets": ["a/b"], "train": {"preset": "gpt2-medium"},
                                       "smoke": {"session_limit_s": 1300}}))
    assert str(err.value) == ("big: smoke.session_limit_s 1300 leaves no training time after the smoke's start-up "
                              "(1310 s) and publish (486 s) margins; raise it, or set it 0 to add smoke.train_s to "
                              "them")
    # A wsd run's two short sessions never reach the end of its stable phase: one checkpoint to publish, once.
    wsd = smoke_config(config_from_dict({"token_datasets": ["a/b"], "train": {"preset": "gpt2", "schedule": "wsd"}}))
    assert wsd.train.settings["keep_stable"] is False and wsd.publish_margin_s == pytest.approx(60 + 149.3710848)


def test_a_smoke_of_checkpoints_kept_in_temp_leaves_time_for_the_sessions_own_publish_check():
    cfg = config_from_dict({"token_datasets": ["a/b"], "train": {"preset": "gpt2-large"},
                            "smoke": {"session_limit_s": 5400}})
    assert cfg.train.settings["checkpoint_dir"].startswith("{temp}")
    size = 12 * MODEL_PRESETS["gpt2-large"].num_params()
    assert smoke_config(cfg).publish_margin_s == pytest.approx(60 + size / 10e6 + 600)


def test_the_smoke_eval_keeps_a_shorter_eval_limit_and_costs_only_its_own_limit():
    cfg = config_from_dict({"token_datasets": ["a/b"], "eval": {"session_limit_s": 300}})
    smoke = smoke_config(cfg)
    # tiny: 1,310 s start-up + 120 s (the least publish margin) + 240 s of training
    assert (smoke.session_limit_s, smoke.eval_session_limit_s) == (1670, 300)
    assert quota_cost_s(smoke) == 2 * 1670 + 300
    # The smoke's own eval limit, where set, still never exceeds the config's.
    own = config_from_dict({"token_datasets": ["a/b"], "smoke": {"eval_session_limit_s": 600}})
    assert smoke_config(own).eval_session_limit_s == 600
    capped = config_from_dict({"token_datasets": ["a/b"], "eval": {"session_limit_s": 300},
                               "smoke": {"eval_session_limit_s": 600}})
    assert smoke_config(capped).eval_session_limit_s == 300
    on_cpu = smoke_config(config_from_dict({"token_datasets": ["a/b"], "eval": {"accelerator": ""}}))
    assert quota_cost_s(on_cpu) == 2 * 1670  # the eval runs on a CPU: no TPU quota


def test_a_configs_own_smoke_slugs_never_reuse_the_real_runs():
    cfg = config_from_dict({"slugs": {"checkpoints": "my-ckpts"}, "token_datasets": ["a/b"],
                            "smoke": {"session_limit_s": 1800}})
    smoke = smoke_config(cfg)
    assert smoke.slug("checkpoints") == "my-ckpts-smoke" and smoke.session_limit_s == 1800
    assert smoke.tokenize == TokenizeSection.of({}) and smoke.token_datasets == ["a/b"]  # no parts to shorten: as given
    with pytest.raises(UserError, match="unknown smoke key.*minutes"):
        config_from_dict({"token_datasets": ["a/b"], "smoke": {"minutes": 10}})


def _write_session(folder: Path, records: list[dict], facts: dict | None = None, publish: dict | None = None):
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if facts:
        (folder / "session-facts.json").write_text(json.dumps(facts))
    if publish:
        (folder / "publish.json").write_text(json.dumps(publish))


def test_the_readiness_report_marks_a_missing_secret_a_wrong_tpu_and_a_wrong_resume_step(tmp_path):
    smoke = smoke_config(load_config(REPO / "examples" / "chain-gpt2-124m.json"))
    state = {"tokenize": {"0": "COMPLETE"}, "tokenize_seconds": {"0": 80.0},
             "train_sessions": [{"n": 1, "published_by": "chain"}, {"n": 2}], "eval": {"status": "ERROR",
                                                                                      "message": "exit 1"}}
    (tmp_path / "state.json").write_text(json.dumps(state))
    s1 = [{"event": "session_start", "step": 0, "device": "xla:TPU v4 x8 (SPMD)", "tpu": "v4", "attention": "sdpa"},
          {"step": 10, "loss": 9.0, "tokens_per_s": 1000.0, "mfu": 0.01},
          {"step": 20, "loss": 8.0, "tokens_per_s": 400_000.0, "mfu": 0.22},
          {"event": "session_end", "step": 20, "compile_s": 95.0, "unix_time": 1000.0}]
    _write_session(tmp_path / "sessions" / "train-01", s1,
                   facts={"packages": {"kaggle": {"from": "installed", "seconds": 14.2}},
                          "secrets": {"KAGGLE_USERNAME": True, "KAGGLE_KEY": False}},
                   publish={"published": False, "reason": "secret missing"})
    s2 = s1 + [{"event": "session_start", "step": 10, "tpu": "v4", "unix_time": 1130.0},
               {"step": 30, "loss": 7.0, "tokens": 30_000, "elapsed_s": 50.0, "tokens_per_s": 450.0, "mfu": 0.25},
               # Host ahead: step 40's read came early, step 50's waited for it too (each window's own rate is off)
               {"step": 40, "loss": 6.5, "tokens": 40_000, "elapsed_s": 50.01, "tokens_per_s": 1e6, "mfu": 0.5,
                "mfu_llmc": 0.46},
               {"step": 50, "loss": 6.4, "tokens": 50_000, "elapsed_s": 50.1, "tokens_per_s": 111_111.1,
                "mfu": 0.0555556, "mfu_llmc": 0.0511111},
               {"event": "session_end", "step": 50, "compile_s": 4.0, "compile_cache": {"hits": 3, "misses": 0}}]
    _write_session(tmp_path / "sessions" / "train-02", s2)
    rows, measured = readiness_rows(smoke, tmp_path)
    by = {r.link: r for r in rows}
    assert (by["tokenize part"].ok, by["tokenize part"].detail) == (True, "50,000,000 tokens in 80 s")
    assert (by["packages"].ok, by["packages"].detail) == (True, "kaggle installed (14 s)")
    assert (by["secrets"].ok, by["secrets"].detail) == (False, "missing: KAGGLE_KEY")
    assert (by["device"].ok, by["device"].detail) == (False, "xla:TPU v4 x8 (SPMD), TPU v4 (expected v5e)")
    assert (by["resume"].ok, by["resume"].detail) == (False, "session 2 started at step 10, session 1 ended at 20")
    assert by["compile"].ok and by["compile"].detail.endswith("cache hits 3, found but not loadable 0, misses 0")
    # session 2's steps after its first window (20 of 1,000 tokens) over the 0.1 s between the reads that end them
    # (the median of its windows would say 555,556)
    assert by["tokens/s and MFU"].detail == ("200,000 tokens/s, MFU 10.0% (llm.c's count 9.2%) (session 2: 20 steps "
                                             "in 0.1 s after its first log window)")
    assert (by["publish"].ok, by["publish"].detail) == (True, "from the output by the chain (secret missing)")
    assert by["session 1 end -> session 2 start"].detail.startswith("130 s")
    assert (by["eval"].ok, by["eval"].detail) == (False, "exit 1")
    assert measured["tokens_per_s"] == pytest.approx(200_000) and measured["accelerator"] == "TpuV5E8"
    assert measured["mfu"] == pytest.approx(0.1) and measured["mfu_llmc"] == pytest.approx(0.092)
    assert report_lines(rows)[-1] == "not ready: fix the rows marked ✗ first"
    out = tmp_path / "measured.json"
    record_measurement(measured, out)
    record_measurement({**measured, "tokens_per_s": 1.0, "local_kaggle": True}, out)  # a stand-in is no TPU
    assert [r["tokens_per_s"] for r in json.loads(out.read_text())] == [pytest.approx(200_000)]


def test_the_readiness_report_sets_the_measured_step_time_beside_the_compilers_roofline_for_that_step(tmp_path):
    cfg = load_config(REPO / "examples" / "chain-gpt2-124m.json")
    settings = cfg.train_settings
    asked = []

    def compile_step(settings, tpu, log, attention):  # the compile tool's report (its fields as analyse gives them)
        asked.append((settings["micro_batch"], tpu, attention))
        return {"step_s": 0.4, "step_mxu_s": 0.5, "micro_batch": 128}

    start = {"event": "session_start", "tpu": "v5e", "attention": "pallas-flash", "micro_batch": 128}
    throughput = Throughput(tokens=524_288 * 20, steps=20, seconds=20 * 0.52)  # 0.52 s a step
    row = roofline_row(settings, start, throughput, local=False, compile_step=compile_step)
    # The step the session ran (its probes chose flash), as the chain's start compiled it (micro_batch auto)
    assert asked == [("auto", "v5e-8", "flash")]
    assert (row.ok, row.detail) == (True, "measured 520 ms a step, the compiler's roofline 400 ms (1.30x) for the "
                                          "flash step at micro-batch 128 on v5e-8; 1.04x with its kernels at the "
                                          "head dim's MXU share")
    assert roofline_row(settings, {**start, "micro_batch": 64}, throughput, False, compile_step).detail.endswith(
        "(the session ran micro-batch 64)")
    assert roofline_row(settings, start, throughput, local=True).ok is None

    def no_compiler(*args, **kwargs):
        raise UserError("the TPU compiler is not installed")

    assert roofline_row(settings, start, throughput, False, no_compiler).detail == (
        "not compared: the TPU compiler is not installed")


def test_the_readiness_report_marks_a_jax_other_than_the_kernels_are_written_against(tmp_path):
    smoke = smoke_config(load_config(REPO / "examples" / "chain-gpt2-124m.json"))
    planned = {"python": "3.12.11", "jax": "0.7.2", "jaxlib": "0.7.2", "libtpu": "0.0.17", "torchax": "0.0.4",
               "mosaic": "4 (pinned)"}

    def jax_row(versions: dict, facts: dict | None = None) -> Row:
        workdir = tmp_path / f"smoke-{len(list(tmp_path.iterdir()))}"  # a smoke's workdir of its own
        workdir.mkdir()
        (workdir / "state.json").write_text(json.dumps({"train_sessions": [{"n": 1}]}))
        start = {"event": "session_start", "step": 0, "tpu": "v5e", "versions": versions}
        _write_session(workdir / "sessions" / "train-01", [start], facts=facts)
        return {r.link: r for r in readiness_rows(smoke, workdir)[0]}["jax"]

    assert jax_row(planned) == Row("jax", True, "jax 0.7.2, jaxlib 0.7.2, libtpu 0.0.17, torchax 0.0.4, mosaic 4 "
                                                "(pinned): those the kernels are written against")
    # A rebuild of the image resolved a newer jax (its requirements leave jax[tpu] unpinned).
    assert jax_row({**planned, "jax": "0.8.0", "jaxlib": "0.8.0", "mosaic": None}) == Row(
        "jax", False, "jax 0.8.0, jaxlib 0.8.0, libtpu 0.0.17, torchax 0.0.4; the kernels are written against jax "
        "0.7.2, jaxlib 0.7.2 (splash's backward rule, the Mosaic version ladder: shared/tpu.py PLAN_TPU_VERSIONS)")
    assert jax_row({**planned, "jax": None}).ok is False  # no jax at all: no Pallas kernel
    local = jax_row({**planned, "jax": "0.8.0"}, facts={"session": {"local_kaggle": True}})
    assert local.ok is None and local.detail.endswith("(the local Kaggle has no TPU: its jax is the stand-in's)")
    assert jax_row({}) == Row("jax", None, "session 1 reported no versions")


def test_a_report_with_no_failed_row_says_ready():
    rows = [Row("a", True, "x"), Row("device", None, "local")]
    assert report_lines(rows)[-1] == "ready: every link works" and "–" in report_lines(rows)[-3]


@pytest.mark.slow
def test_smoke_on_the_local_kaggle_proves_every_link(tmp_path):
    proc = run_script("scripts/chain_sessions.py", "--local-demo", "--smoke", "--workdir", str(tmp_path),
                      timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Said before it starts: 2 sessions of 180 s (a resumed session's start-up took 87 s on a loaded 2-core machine,
    # past the 73 s of training a 120-s session left), an eval of 300.
    assert "at most 11 min of TPU quota" in proc.stdout
    report = json.loads((tmp_path / "chain" / "readiness.json").read_text())
    by = {r["link"]: r for r in report["rows"]}
    state = json.loads((tmp_path / "chain" / "state.json").read_text())
    first, second = state["train_sessions"]
    assert by["tokenize part"]["ok"] and by["tokenize part"]["detail"].startswith("40,000 tokens")
    assert by["packages"]["ok"] and "kaggle" in by["packages"]["detail"]
    assert by["secrets"] == {"link": "secrets", "ok": True, "detail": "KAGGLE_KEY, KAGGLE_USERNAME found"}
    assert by["device"]["ok"] is None and by["device"]["detail"].startswith("xla:CPU")
    assert by["attention kernel"] == {"link": "attention kernel", "ok": True, "detail": "sdpa"}
    assert by["resume"]["ok"] and first["step_after"] > 0
    assert by["resume"]["detail"] == (f"session 2 started at step {first['step_after']}, session 1 ended at "
                                      f"{first['step_after']}")
    assert second["step_after"] > first["step_after"]
    # the compiled graphs travelled with the checkpoint and were found; torch_xla's CPU backend cannot load them
    assert by["compile"]["ok"] is None and re.search(r"found but not loadable [1-9]", by["compile"]["detail"])
    assert by["tokens/s and MFU"]["ok"] and re.search(r"tokens/s, MFU n/a \(no TPU\) \(session [12]: \d+ steps in "
                                                     r"[\d.]+ s after its first log window\)$",
                                                     by["tokens/s and MFU"]["detail"])
    assert by["step time / roofline"] == {"link": "step time / roofline", "ok": None,
                                          "detail": "local Kaggle: its CPUs are no TPU"}
    # each session traced 3 compiled steps on the CPU devices, and the chain fetched the traces with its outputs
    assert by["profile"]["ok"] and by["profile"]["detail"].startswith("2 trace(s), ")
    assert by["publish"] == {"link": "publish", "ok": True, "detail": by["publish"]["detail"]}
    assert by["publish"]["detail"].startswith("in-session")
    assert by["session 1 end -> session 2 start"]["ok"]
    assert by["eval"]["ok"] and "HellaSwag" in by["eval"]["detail"] and "on 20 examples" in by["eval"]["detail"]
    assert "chain" not in by and "ready: every link works" in proc.stdout
    assert report["measured"]["local_kaggle"] is True
