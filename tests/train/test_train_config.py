"""TrainConfig in sections: every field in exactly one, --help grouped by them, settings accepted flat or nested,
and each section's checks run however the config is built."""

import argparse
import dataclasses

import pytest

from shared.config import TRAIN_SECTIONS, TrainConfig
from shared.errors import UserError
from shared.flags import add_dataclass_args
from shared.train_sections import flatten_sections


def from_file(settings: dict, **fixed) -> TrainConfig:
    """A TrainConfig from settings as a config file writes them (flat or in sections), `fixed` over them."""
    return TrainConfig(**{**flatten_sections(settings), **fixed})


def test_every_train_setting_lives_in_exactly_one_section_in_help_order():
    owners: dict[str, list[str]] = {}
    for name, section in TRAIN_SECTIONS.items():
        for f in dataclasses.fields(section):
            owners.setdefault(f.name, []).append(name)
    assert {k: v for k, v in owners.items() if len(v) > 1} == {}
    train_fields = [f.name for f in dataclasses.fields(TrainConfig)]
    assert set(train_fields) == set(owners)
    # the flags run section by section, in TRAIN_SECTIONS' order
    assert [owners[name][0] for name in train_fields] == sorted(
        (owners[name][0] for name in train_fields), key=list(TRAIN_SECTIONS).index)
    assert train_fields[:2] == ["preset", "seq_len"] and train_fields[-1] == "profile_steps"


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
    assert (short.lr, short.total_steps, short.bf16, short.micro_batch, short.seq_len) == (0.001, 5, False, "auto", 64)


def test_nested_and_flat_settings_build_the_same_config():
    flat = {"preset": "tiny", "lr": 0.0036, "optimizer": "muon", "muon_lr": 0.00036, "warmup_steps": 0,
            "schedule": "wsd", "eval_every": 50, "micro_batch": 8}
    nested = {"model": {"preset": "tiny"}, "optim": {"lr": 0.0036, "optimizer": "muon", "muon_lr": 0.00036},
              "lr_schedule": {"warmup_steps": 0, "schedule": "wsd"}, "evals": {"eval_every": 50}, "micro_batch": 8}
    built = from_file(nested, total_steps=99)
    assert built == from_file(flat, total_steps=99) == TrainConfig(**flat, total_steps=99)
    assert (built.lr, built.muon_lr, built.schedule, built.eval_every, built.total_steps) == (
        0.0036, 0.00036, "wsd", 50, 99)


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
    for build in (lambda: TrainConfig(**changes), lambda: dataclasses.replace(TrainConfig(), **changes),
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
    assert (nested_cfg.train.config.muon_lr, nested_cfg.train.config.cooldown_frac) == (0.00036, 0.29)
    with pytest.raises(UserError) as err:
        config_from_dict({**raw, "train": {**nested, "optim": {**nested["optim"], "eval_every": 100}}}, "c.json")
    assert str(err.value) == ("c.json: train.optim: eval_every is not a setting of this section; it belongs in the "
                              "evals section")


def test_a_runs_length_is_total_steps_and_its_old_name_max_steps_still_reads():
    from shared.flags import parse_dataclass

    assert parse_dataclass(TrainConfig, ["--max-steps", "5"]).total_steps == 5  # the old flag, an alias
    assert parse_dataclass(TrainConfig, ["--total-steps", "7"]).total_steps == 7
    assert parse_dataclass(TrainConfig, [], defaults={"max_steps": 9}).total_steps == 9  # an older build's bake
    assert from_file({"max_steps": 11}).total_steps == 11
    assert from_file({"lr_schedule": {"max_steps": 12}}).total_steps == 12
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
    cfg.lr = -1.0  # the optimizer's section; the logging section's check alone would pass it
    with pytest.raises(UserError):
        cfg.check()
    cfg.lr, cfg.warmup_steps = TrainConfig().lr, -1  # the schedule's
    with pytest.raises(UserError):
        cfg.check()
