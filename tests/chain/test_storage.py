"""The two checkpoint datasets under the account's private-dataset quota: a create past it answers "Ok" and lands
nothing (kaggle-cli issue 284), so the chain keeps their versions (a session's midway one included) under it, and
--plan says the most it keeps live at once."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from helpers import REPO
from kaggle_fixtures import write_dataset

from scripts.chain.checkpoints import note_version, publish_target, session_publishes
from scripts.chain.config import config_from_dict
from scripts.chain.storage import private_taken, room_line, storage_line, storage_plan
from shared.errors import UserError

NINE_HOURS = 9 * 3600


def gpt2_config(quota_versions: float, keep: int = 2, **more):
    """A gpt2 (124M) chain whose quota holds `quota_versions` checkpoint versions."""
    cfg = config_from_dict({"token_datasets": ["a/b"], "train": {"preset": "gpt2"}, "keep_dataset_versions": keep})
    return config_from_dict({"token_datasets": ["a/b"], "train": {"preset": "gpt2"}, "keep_dataset_versions": keep,
                             "dataset_quota_gb": quota_versions * cfg.checkpoint_bytes / 1e9, **more})


def test_a_quota_with_room_keeps_what_the_config_asks_and_publishes_midway():
    plan = storage_plan(gpt2_config(100))
    # From 1 live in the dataset published to, a session adds its midway and final versions (3 > 2 kept), so its
    # final create deletes the older: 3 there, before Kaggle deletes them, and 1 in the other dataset: 4 at once.
    assert (plan.keep, plan.midway, plan.peak_versions, plan.lowered) == (2, True, 4, "")
    assert plan.peak_bytes == 4 * plan.version_bytes
    # keep 3 with a midway version: 3 live in each (1, +2), then +2 in one: 8 at once.
    assert storage_plan(gpt2_config(100, keep=3)).peak_versions == 8
    # without: 3 in each (1, +1, +1), then the deleting create in one: 7.
    assert storage_plan(gpt2_config(100, keep=3), midway=False).peak_versions == 7
    # 0 keeps as many as fit: room for 10. Keeping 4, each holds 3 between sessions (1, +2), +2 in one: 8 at once;
    # keeping 5 would reach 12.
    assert storage_plan(gpt2_config(10.5, keep=0)).keep == 4


def test_a_tight_quota_keeps_fewer_versions_then_skips_the_midway_publish_and_says_so():
    plan = storage_plan(gpt2_config(4.5, keep=4))
    assert (plan.keep, plan.midway, plan.peak_versions) == (2, True, 4)
    assert plan.lowered == "keep_dataset_versions 2, not 4, to fit the quota"
    plan = storage_plan(gpt2_config(3.5))
    assert (plan.keep, plan.midway, plan.peak_versions) == (1, False, 3)
    assert plan.lowered == "keep_dataset_versions 1, not 2 and no midway publish, to fit the quota"
    line = storage_line(plan)
    assert line.startswith("at most 3 checkpoint versions live at once in the two checkpoint datasets, 1.5 GB each: "
                           "4.5 GB of the 5.2")
    assert line.endswith(" GB private-dataset quota (dataset_quota_gb; keep_dataset_versions 1, not 2 and no midway "
                         "publish, to fit the quota); a session adds 1 to the one it publishes to, and where more than "
                         "1 would stay there, its final create deletes that one's older versions (one upload, counted "
                         "before Kaggle deletes them; the other dataset keeps the checkpoint it resumed from)")


def test_a_quota_that_cannot_hold_three_versions_is_refused_before_anything_is_pushed():
    with pytest.raises(UserError, match=r"^config: a checkpoint version is 1\.5 GB: three \(the one each checkpoint "
                                        r"dataset keeps, and the next\) do not fit the 4\.18\d* GB "
                                        r"private-dataset quota \(dataset_quota_gb\)"):
        gpt2_config(2.8)
    with pytest.raises(UserError, match=r"^config: dataset_quota_gb must be a number of GB > 0, got -1$"):
        config_from_dict({"token_datasets": ["a/b"], "dataset_quota_gb": -1})


def refs_ctx(cfg, data: dict) -> SimpleNamespace:
    """What session_publishes and note_version read: the config, the state, and the datasets' refs."""
    return SimpleNamespace(cfg=cfg, ref=lambda slug: f"alice/{slug}",
                           state=SimpleNamespace(data=data, save=lambda: None))


@pytest.mark.parametrize(("quota_versions", "keep"), [(100, 2), (100, 3), (4.5, 2), (3.5, 2), (6.2, 0), (5, 5)])
def test_sessions_never_hold_more_versions_than_the_plan_says_nor_than_the_quota_holds(quota_versions, keep):
    """Random sessions, some killed before their final publish (their midway version stays), each publishing to
    the checkpoint dataset that does not hold the newest checkpoint: the versions live in both at any moment (a
    create counted before Kaggle deletes the older) stay within the plan's peak, and within the quota always."""
    cfg = gpt2_config(quota_versions, keep=keep)
    plan, room = storage_plan(cfg), cfg.dataset_room()
    rng = random.Random(quota_versions * 100 + keep)
    first, second = "alice/gpt2-checkpoints", "alice/gpt2-checkpoints-b"
    keys = {first: "checkpoint_versions", second: "checkpoint_versions_b"}
    for killed_share in (0.0, 0.3):
        ctx = refs_ctx(cfg, {"checkpoint_versions": [1], "checkpoint_versions_b": [1]})
        newest, holder, most, midways = {first: 1, second: 1}, None, 2, 0
        for _ in range(60):
            target = publish_target(ctx, holder)
            live = {ref: list(ctx.state.data[key]) for ref, key in keys.items()}
            others = sum(len(v) for ref, v in live.items() if ref != target)
            delete, midway = session_publishes(ctx, newest[target], NINE_HOURS, ref=target)
            if midway:
                newest[target] += 1
                live[target].append(newest[target])
                most, midways = max(most, others + len(live[target])), midways + 1
            if rng.random() < killed_share:  # killed before its final publish: the chain takes the midway version
                if midway:
                    note_version(ctx, newest[target], False, ref=target)
                    holder = target
                continue
            newest[target] += 1  # the final version: its create deletes the older where `delete`, counted beside them
            live[target].append(newest[target])
            most = max(most, others + len(live[target]))
            note_version(ctx, newest[target], delete, ref=target)
            holder = target
            assert ctx.state.data[keys[target]] == ([newest[target]] if delete else live[target])
        assert most <= room
        if not killed_share:
            assert most == plan.peak_versions and midways == (60 if plan.midway else 0)


def test_other_private_datasets_leave_less_room_and_the_sessions_keep_their_peak_within_what_is_left():
    cfg = gpt2_config(8.5, keep=3)  # 8.5 versions' worth: alone, keep 3 with a midway version, 8 at once
    size = cfg.version_bytes
    alone, shared = storage_plan(cfg), storage_plan(cfg, taken=4 * size)  # others take four versions' worth
    assert (alone.keep, alone.midway, alone.peak_versions) == (3, True, 8)
    assert (shared.keep, shared.midway, shared.peak_versions, shared.taken) == (2, True, 4, 4 * size)
    assert shared.peak_bytes + shared.taken <= shared.quota_bytes
    ctx = refs_ctx(cfg, {"checkpoint_versions": [1, 2, 3], "checkpoint_versions_b": [1],
                         "private_datasets": {"taken": 4 * size}})
    # 3 live + midway + final passes the 2 kept: the final deletes; the midway fits only where it and the final do
    # beside the 3 and the other dataset's 1
    assert session_publishes(ctx, 3, NINE_HOURS) == (True, False)
    assert session_publishes(ctx, 1, NINE_HOURS, ref="alice/gpt2-checkpoints-b") == (True, False)
    with pytest.raises(UserError, match=r"do not fit the 12\.6\d* GB private-dataset quota \(dataset_quota_gb\) "
                                        r"less the 9\.0 GB your other private datasets take; raise it if your account "
                                        r"has more, free space on Kaggle, or train a smaller model$"):
        storage_plan(cfg, taken=6 * size)


def test_plan_says_what_the_other_private_datasets_take_and_the_room_left():
    cfg = gpt2_config(100, token_datasets=["alice/tokens"])
    datasets = {"alice/tokens": 3_000_000_000, "alice/photos": 7_000_000_000, "alice/gpt2-checkpoints": 9 * 10**9}
    taken = private_taken(datasets, "alice/gpt2-checkpoints")
    assert taken == 10_000_000_000  # the checkpoint dataset is the storage plan's own
    plan = storage_plan(cfg, taken=taken)
    others = {ref: size for ref, size in datasets.items() if ref != "alice/gpt2-checkpoints"}
    left = plan.quota_bytes - taken
    assert room_line(cfg, plan, others, "") == (
        f"2 other private dataset(s) of yours take 10.0 GB, the token datasets 3.0 GB of it (ListDatasets' sizes): "
        f"{left / 1e9:.1f} GB of the quota is left, {(left - plan.peak_bytes) / 1e9:.1f} GB of it beyond the "
        "checkpoint versions at their most")
    assert room_line(cfg, plan, None, "", "no credentials found") == (
        f"your other private datasets were not read (no credentials found): the whole {plan.quota_bytes / 1e9:g} GB "
        "quota is counted as the chain's; they share it")


def test_the_local_kaggle_lists_the_users_private_datasets_with_their_sizes(local_kaggle, tmp_path):
    lk = local_kaggle
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "a", "alice/other-a", {"a.bin": b"a" * 1000})))
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "b", "alice/tokens-b", {"b.bin": b"b" * 300})))
    lk.cli("datasets", "create", "-u", "-p", str(write_dataset(tmp_path / "c", "alice/open-c", {"c.bin": b"c" * 50})))
    code = (f"import json, sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from scripts.chain.client import KaggleClient\n"
            "from scripts.chain.config import config_from_dict\n"
            "client = KaggleClient(config_from_dict({'token_datasets': ['a/b']}).client)\n"
            "client.connect()\n"
            "print(json.dumps(client.private_datasets()))\n")
    listed = json.loads(lk.python(code).stdout.splitlines()[-1])
    assert listed == {"alice/other-a": 1000, "alice/tokens-b": 300}  # the public one takes none of the quota
