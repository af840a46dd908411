"""TrainConfig in sections: every field in exactly one, --help grouped by them, settings accepted flat or nested,
and each section's checks run however the config is built."""

import argparse
import dataclasses
import json

import pytest

from shared.config import TRAIN_SECTIONS, TrainConfig
from shared.errors import UserError
from shared.flags import add_dataclass_args
from shared.model_shape import MODEL_PRESETS
from shared.train_sections import flatten_sections


def from_file(settings: dict, **fixed) -> TrainConfig:
    """A TrainConfig from settings as a config file writes them (flat or in sections), `fixed` over them."""
    return TrainConfig.from_dict({**flatten_sections(settings), **fixed})


def test_a_train_config_holds_one_object_per_section_in_help_order():
    cfg = TrainConfig()
    assert [f.name for f in dataclasses.fields(TrainConfig)] == list(TRAIN_SECTIONS)
    assert all(type(getattr(cfg, name)) is section for name, section in TRAIN_SECTIONS.items())
    assert dataclasses.is_dataclass(cfg.optim) and cfg.optim.lr == 6e-4 and cfg.lr_schedule.total_steps == 19073
    assert cfg.model.shape == MODEL_PRESETS["tiny"] and cfg.model.preset == "tiny"
    assert TrainConfig.from_dict({"seq_len": 64}).model.shape.block_size == 64
    # the sections are separate objects: a config's copy shares none with another's
    assert TrainConfig().optim is not cfg.optim


def test_a_setting_name_is_one_sections_so_a_flat_config_and_a_short_flag_name_one_setting():
    owners: dict[str, list[str]] = {}
    for name, section in TRAIN_SECTIONS.items():
        for f in dataclasses.fields(section):
            owners.setdefault(f.name, []).append(name)
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}
    # the flags run section by section, in TRAIN_SECTIONS' order
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, TrainConfig)
    dests = [a.dest for a in parser._actions if a.dest != "help"]
    assert set(dests) == set(owners) and len(dests) == len(owners)
    assert [owners[d][0] for d in dests] == sorted((owners[d][0] for d in dests), key=list(TRAIN_SECTIONS).index)
    assert dests[:2] == ["preset", "seq_len"] and dests[-1] == "profile_steps"


def test_to_dict_nests_by_section_and_from_dict_reads_it_back():
    cfg = TrainConfig.from_dict({"optim": {"lr": 1e-3}, "total_steps": 50, "micro_batch": 4})
    saved = cfg.to_dict()
    assert list(saved) == list(TRAIN_SECTIONS)
    assert saved["optim"]["lr"] == 1e-3 and saved["lr_schedule"]["total_steps"] == 50
    assert saved["step"]["micro_batch"] == 4 and "lr" not in saved
    assert TrainConfig.from_dict(saved) == cfg
    assert TrainConfig.from_dict(json.loads(json.dumps(saved))) == cfg


def test_a_flat_config_from_before_the_sections_and_its_old_names_convert():
    """Checkpoints and chain configs written before the sections were objects carry the settings flat (and a run's
    length as max_steps before that): the one converter reads them as the nested config."""
    cfg = TrainConfig.from_dict({"lr": 1e-3, "total_steps": 50, "micro_batch": 4, "optimizer": "muon"})
    flat_before = {key: value for section in cfg.to_dict().values() for key, value in section.items()}
    assert TrainConfig.from_dict(flat_before) == cfg
    older = {**{k: v for k, v in flat_before.items() if k != "total_steps"}, "max_steps": 50}
    assert TrainConfig.from_dict(older) == cfg


def test_replace_changes_settings_by_name_in_their_sections_and_checks_again():
    cfg = TrainConfig()
    changed = cfg.replace(lr=1e-3, micro_batch=8)
    assert (changed.optim.lr, changed.step.micro_batch, cfg.optim.lr, cfg.step.micro_batch) == (1e-3, 8, 6e-4, 16)
    assert changed.lr_schedule == cfg.lr_schedule and changed.lr_schedule is not cfg.lr_schedule  # a copy
    changed.lr_schedule.warmup_steps = 3
    assert cfg.lr_schedule.warmup_steps == 715
    with pytest.raises(UserError, match="unknown train setting"):
        cfg.replace(learning_rate=1e-3)
    with pytest.raises(UserError, match="--lr must be positive"):
        cfg.replace(lr=0.0)


def test_a_section_that_is_not_its_settings_object_is_a_one_line_error():
    with pytest.raises(UserError, match="train.optim: expected a OptimizerSettings"):
        TrainConfig(optim={"lr": 1e-3})


def test_help_lists_each_flag_under_its_section():
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, TrainConfig)
    groups = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    assert {"model", "data", "optim", "lr_schedule", "step", "session", "evals", "logging"} <= set(groups)
    assert {"lr", "muon_lr", "grad_clip"} <= groups["optim"]
    assert "preset" in groups["model"] and "preset" not in groups["optim"]
    assert {"warmup_steps", "cooldown_frac", "total_steps"} <= groups["lr_schedule"]
    assert groups["step"] >= {"micro_batch", "attention"}
    help_text = parser.format_help()
    body = help_text[help_text.index("\noptions:"):]  # past the usage line, which lists every flag
    assert body.index("\noptim:") < body.index("--optim.muon_lr MUON_LR, --muon-lr MUON_LR") < body.index(
        "\nlr_schedule:")


def test_a_flag_names_its_section_and_key_and_the_short_flag_is_an_alias():
    from shared.flags import parse_dataclass

    by_place = parse_dataclass(TrainConfig, ["--optim.lr", "0.001", "--lr_schedule.total_steps", "5", "--no-step.bf16",
                                             "--step.micro_batch", "auto", "--model.seq_len", "64"])
    short = parse_dataclass(TrainConfig, ["--lr", "0.001", "--total-steps", "5", "--no-bf16", "--micro-batch", "auto",
                                          "--seq-len", "64"])
    assert by_place == short
    assert (short.optim.lr, short.lr_schedule.total_steps, short.step.bf16, short.step.micro_batch,
            short.model.seq_len) == (0.001, 5, False, "auto", 64)


def test_nested_and_flat_settings_build_the_same_config():
    flat = {"preset": "tiny", "lr": 0.0036, "optimizer": "muon", "muon_lr": 0.00036, "warmup_steps": 0,
            "schedule": "wsd", "eval_every": 50, "micro_batch": 8}
    nested = {"model": {"preset": "tiny"}, "optim": {"lr": 0.0036, "optimizer": "muon", "muon_lr": 0.00036},
              "lr_schedule": {"warmup_steps": 0, "schedule": "wsd"}, "evals": {"eval_every": 50}, "micro_batch": 8}
    built = from_file(nested, total_steps=99)
    assert built == from_file(flat, total_steps=99) == TrainConfig.from_dict({**flat, "total_steps": 99})
    assert (built.optim.lr, built.optim.muon_lr, built.lr_schedule.schedule, built.evals.eval_every,
            built.lr_schedule.total_steps) == (0.0036, 0.00036, "wsd", 50, 99)


@pytest.mark.parametrize("settings, message", [
    ({"optim": {"preset": "gpt2"}},
     "train.optim: preset is not a setting of this section; it belongs in the model section"),
    ({"optim": {"lr": 1e-3}, "lr": 2e-3}, "train: lr is set twice (train.lr and train.optim.lr)"),
    ({"optim": 0.001}, "train.optim: a section of settings"),
    ({"optim": {"learning_rate": 1e-3}}, "train.optim: learning_rate is not a setting of this section"),
    ({"learning_rate": 1e-3}, "train: unknown train setting(s) learning_rate; known: preset,"),
])
def test_a_misplaced_or_doubled_nested_setting_is_a_one_line_error(settings, message):
    with pytest.raises(UserError) as err:
        from_file(settings)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.parametrize("changes, message", [
    ({"cooldown_frac": 0.0}, "--cooldown-frac must be in (0, 1], got 0.0"),
    ({"muon_momentum": 1.0}, "--muon-momentum must be in [0, 1), got 1.0"),
    ({"on_data_change": "ignore"}, "--on-data-change"),
    ({"keep_checkpoints": 0}, "--keep-checkpoints"),
    ({"log_every": 0}, "--log-every"),
    ({"eval_batches": 0}, "--eval-batches"),
    ({"seq_len": 2048, "preset": "gpt2"}, "--seq-len 2048 exceeds gpt2's block size 1024"),
    ({"total_batch_tokens": 1000, "micro_batch": 4}, "--total-batch-tokens 1000 is not a multiple"),
])
def test_each_sections_checks_run_however_the_config_is_built(changes, message):
    for build in (lambda: TrainConfig.from_dict(changes), lambda: TrainConfig().replace(**changes),
                  lambda: from_file(changes)):
        with pytest.raises(UserError) as err:
            build()
        assert message in str(err.value)


def test_a_chain_config_may_write_its_train_settings_in_sections():
    import json

    from scripts.chain.config import config_from_dict
    from shared.config import TRAIN_SECTIONS
    from shared.train_sections import section_fields

    raw = {k: v for k, v in json.loads(open("examples/chain-gpt2-124m-muon.json").read()).items()
           if not k.startswith("_")}
    nested = raw["train"]  # the example is written in sections, each setting in its own (section_fields)
    owner = section_fields(TRAIN_SECTIONS)
    assert all(owner[key] == name for name, section in nested.items() for key in section)
    assert {"model", "optim", "lr_schedule", "step", "evals", "logging"} <= set(nested)
    flat = {key: value for section in nested.values() for key, value in section.items()}
    flat_cfg, nested_cfg = config_from_dict({**raw, "train": flat}), config_from_dict(raw)
    assert nested_cfg.train.settings == flat_cfg.train.settings and nested_cfg.train.config == flat_cfg.train.config
    assert (nested_cfg.train.config.optim.muon_lr, nested_cfg.train.config.lr_schedule.cooldown_frac) == (0.00036, 0.29)
    with pytest.raises(UserError) as err:
        config_from_dict({**raw, "train": {**nested, "optim": {**nested["optim"], "eval_every": 100}}}, "c.json")
    assert str(err.value) == ("c.json: train.optim: eval_every is not a setting of this section; it belongs in the "
                              "evals section")


def test_a_runs_length_is_total_steps_and_its_old_name_max_steps_still_reads():
    from shared.flags import parse_dataclass

    assert parse_dataclass(TrainConfig, ["--max-steps", "5"]).lr_schedule.total_steps == 5  # the old flag, an alias
    assert parse_dataclass(TrainConfig, ["--total-steps", "7"]).lr_schedule.total_steps == 7
    # an older build's bake
    assert parse_dataclass(TrainConfig, [], defaults={"max_steps": 9}).lr_schedule.total_steps == 9
    assert from_file({"max_steps": 11}).lr_schedule.total_steps == 11
    assert from_file({"lr_schedule": {"max_steps": 12}}).lr_schedule.total_steps == 12
    with pytest.raises(UserError, match="total_steps is set twice"):
        from_file({"max_steps": 11, "total_steps": 12})


def test_a_section_built_alone_runs_its_own_checks():
    from shared.train_sections import OptimizerSettings, ScheduleSettings

    assert OptimizerSettings(lr=0.001).lr == 0.001
    with pytest.raises(UserError, match="--muon-momentum must be in"):
        OptimizerSettings(muon_momentum=1.0)
    with pytest.raises(UserError, match="--lr: expected a number"):
        OptimizerSettings(lr="3e-4")
    with pytest.raises(UserError, match="--extend needs --schedule wsd"):
        ScheduleSettings(extend=True)


def test_a_train_configs_check_runs_every_sections_check_not_only_its_first_bases():
    cfg = TrainConfig()
    cfg.optim.lr = -1.0  # the optimizer's section; the logging section's check alone would pass it
    with pytest.raises(UserError):
        cfg.check()
    cfg.optim.lr, cfg.lr_schedule.warmup_steps = TrainConfig().optim.lr, -1  # the schedule's
    with pytest.raises(UserError):
        cfg.check()


def test_a_checkpoints_config_reads_the_same_written_flat_nested_or_under_old_names():
    """Checkpoints written before the sections were objects carry the train settings flat (a run's length as
    max_steps before that, and maybe a setting since removed): a resume (saved_schedule) and an eval (saved_settings)
    read them as they read today's nested ones."""
    from shared.runtime.optim import saved_schedule
    from shared.train_sections import saved_settings

    run = TrainConfig.from_dict({"schedule": "wsd", "total_steps": 8, "cooldown_frac": 0.5, "optimizer": "muon",
                                 "muon_lr": 0.01, "warmup_steps": 2})
    nested = run.to_dict()
    flat = {key: value for section in nested.values() for key, value in section.items()}
    old = {**{k: v for k, v in flat.items() if k != "total_steps"}, "max_steps": 8, "a_setting_since_removed": 1}
    removed_in_a_section = {**nested, "optim": {**nested["optim"], "a_setting_since_removed": 1}}
    now = TrainConfig.from_dict({"schedule": "wsd", "total_steps": 12, "cooldown_frac": 0.5, "seq_len": 64})
    for saved in (nested, flat, old, removed_in_a_section):
        assert saved_settings(saved, "state.json") == flat
        was, step = saved_schedule(now, {"step": 5, "config": {"train": saved}})
        assert step == 5 and (was.optim, was.lr_schedule) == (run.optim, run.lr_schedule) and was.model == now.model
