"""A checkpoint is uploaded once per publish: the chain's two checkpoint datasets are used in turn (docs/kaggle-api.md,
Checkpoint dataset versions). A session resumes from the one holding the newest proven checkpoint and publishes to the
other, whose older versions its one create deletes; so a session killed at any point of its publish leaves a proven
checkpoint, and the chain resumes from whichever dataset holds the newest. Against the local Kaggle, which deletes
the older versions at the create, before the new one is ready or proven (the harsh reading: when Kaggle deletes them
is not verified)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO
from test_chain_datasets import CKPT, add_version, live_numbers, manifest
from test_chain_datasets import probe as chain_probe
from test_publish_proof import PROBE as SESSION_PROBE

SECOND = CKPT + "-b"
MODEL = {"model.safetensors": {"bytes": 5, "sha256": "-"}}


def whole(step: int) -> dict:
    """A checkpoint version's files: a manifest and the one file it names."""
    return {"checkpoint.json": manifest(step, MODEL), "model.safetensors": "12345"}


def two_datasets(lk, tmp_path: Path) -> None:
    """The first checkpoint dataset holds step 20 (the newest, proven); the second an older step 10."""
    add_version(lk, tmp_path, CKPT, whole(20))
    add_version(lk, tmp_path, SECOND, whole(10))


def newest(lk, tmp_path: Path, wait_s: float = 30.0) -> tuple[dict, str]:
    """What a restarted chain resumes from, and the dataset its next session publishes to."""
    return chain_probe(lk, tmp_path, """
        from scripts.chain.checkpoints import newest_proven, publish_target
        out["newest"] = list(newest_proven(ctx))
        out["target"] = publish_target(ctx, out["newest"][0])
    """, wait_s=wait_s)


def test_sessions_publish_in_turn_to_the_dataset_not_holding_the_newest_checkpoint(local_kaggle, tmp_path):
    out, _ = chain_probe(local_kaggle, tmp_path, """
        from scripts.chain.checkpoints import checkpoint_refs, publish_target
        first, second = checkpoint_refs(ctx)
        out["refs"] = [first, second]
        out["turns"] = [publish_target(ctx, None), publish_target(ctx, first), publish_target(ctx, second)]
    """)
    assert out == {"refs": [CKPT, SECOND], "turns": [CKPT, SECOND, CKPT]}


def test_the_chain_resumes_from_whichever_dataset_holds_the_newest_proven_step(local_kaggle, tmp_path):
    lk = local_kaggle
    two_datasets(lk, tmp_path)
    assert newest(lk, tmp_path)[0] == {"newest": [CKPT, 1, 20], "target": SECOND}
    add_version(lk, tmp_path, SECOND, whole(40))
    assert newest(lk, tmp_path)[0] == {"newest": [SECOND, 2, 40], "target": CKPT}
    # A newest version short of a file (a dropped upload) is passed over, in one notice, never resumed from.
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(60, MODEL)})
    out, log = newest(lk, tmp_path)
    assert out == {"newest": [SECOND, 2, 40], "target": CKPT}
    assert f"notice: version 2 of checkpoint dataset {CKPT} lacks model.safetensors; it is passed over" in log


def test_a_newest_version_that_never_becomes_ready_is_passed_over_and_the_other_resumed_from(local_kaggle, tmp_path):
    lk = local_kaggle
    two_datasets(lk, tmp_path)
    lk.app.settings.dataset_ready_delay_s = 600.0  # the next version stays pending past the chain's wait
    add_version(lk, tmp_path, SECOND, whole(40))
    out, log = newest(lk, tmp_path, wait_s=1.0)
    assert out == {"newest": [CKPT, 1, 20], "target": SECOND}
    assert f"notice: checkpoint dataset {SECOND} is passed over: " in log


def test_a_missing_or_empty_second_dataset_is_passed_over(local_kaggle, tmp_path):
    lk = local_kaggle
    add_version(lk, tmp_path, CKPT, whole(20))  # a chain from before the second dataset
    out, log = newest(lk, tmp_path)
    assert out == {"newest": [CKPT, 1, 20], "target": SECOND}
    assert f"notice: checkpoint dataset {SECOND} does not exist yet; it is passed over" in log
    add_version(lk, tmp_path, SECOND, {"README.md": "no checkpoint"})
    out, log = newest(lk, tmp_path)
    assert out == {"newest": [CKPT, 1, 20], "target": SECOND} and "passed over" not in log


# Each kills the publishing process (os._exit: no cleanup, no record) at one point of the single-upload publish.
KILLS = {
    "before_upload": """
        publish.push_dataset_folder = lambda *a, **k: os._exit(137)
    """,
    "mid_upload": """
        uploaded = []
        upload = api._upload_file
        def killed_after_one(*a, **k):
            if uploaded:
                os._exit(137)
            uploaded.append(upload(*a, **k))
            return uploaded[-1]
        api._upload_file = killed_after_one
    """,
    "after_upload": """
        push = publish.push_dataset_folder
        publish.push_dataset_folder = lambda *a, **k: (push(*a, **k), os._exit(137))
    """,
    "after_proof": """
        verify = publish.verify_publish
        proven = lambda *a, **k: print("PROOF " + json.dumps(verify(*a, **k)), flush=True)
        publish.verify_publish = lambda *a, **k: (proven(*a, **k), os._exit(137))
    """,
}

KILLED_PUBLISH = """
import os
{kill}
plan = publish.PublishPlan(CKPT, delete_old_versions=True, verify_s=5.0, poll_s=(0.05, 0.2))
publish.kaggle_api = lambda from_secrets=False: api
publish._publish(plan, checkpoint(40), 40, {{}}, print, work_dir=work / "upload")
"""


@pytest.mark.parametrize(("point", "resumed", "second_live"), [
    ("before_upload", [CKPT, 1, 20], [1]),
    ("mid_upload", [CKPT, 1, 20], [1]),
    ("after_upload", [SECOND, 2, 40], [2]),
    ("after_proof", [SECOND, 2, 40], [2]),
])
def test_a_publish_killed_at_any_point_leaves_a_proven_checkpoint_and_the_chain_resumes_from_the_newest(
        local_kaggle, tmp_path, point, resumed, second_live):
    """The session resumed from step 20 in the first dataset and publishes step 40 to the second, deleting its
    older versions at the create: killed before, during or after its one upload, before or after its proof."""
    lk = local_kaggle
    two_datasets(lk, tmp_path)
    lk.app.settings.dataset_ready_delay_s = 1.0  # a new version is not ready at once
    kill = KILLS[point].strip("\n")
    body = KILLED_PUBLISH.format(kill="\n".join(line[8:] for line in kill.splitlines()))
    code = SESSION_PROBE.format(repo=str(REPO), ckpt=SECOND, work=str(tmp_path / "work"), body=body)
    proc = lk.python(code, check=False, timeout=180)
    assert proc.returncode == 137, proc.stdout + proc.stderr
    if point == "after_proof":
        assert 'PROOF {"verified_version": 2, "republished": false}' in proc.stdout  # proven, then killed
    out, _ = newest(lk, tmp_path)
    assert out["newest"] == resumed
    assert live_numbers(lk, CKPT) == [1]  # the checkpoint it resumed from, never deleted
    assert live_numbers(lk, SECOND) == second_live  # the create deleted the older step 10 there
    # The next session publishes to the dataset that does not hold the newest checkpoint.
    assert out["target"] == (CKPT if resumed[0] == SECOND else SECOND)


def test_a_deleting_version_that_is_short_of_a_file_leaves_the_other_datasets_checkpoint(local_kaggle, tmp_path):
    """The one upload drops a file (kaggle 2.2.4 without our check) and the session is killed before publishing
    again: the second dataset's older versions are gone, its new one is not whole, and the chain resumes from the
    first dataset's step 20."""
    lk = local_kaggle
    two_datasets(lk, tmp_path)
    lk.app.inject("failed_upload", name="model.safetensors", count=1)
    body = KILLED_PUBLISH.format(kill="\n".join([
        "import contextlib",
        "publish.failed_uploads_raise = lambda api: contextlib.nullcontext()",
        "push = publish.push_dataset_folder",
        "publish.push_dataset_folder = lambda *a, **k: (push(*a, **k), os._exit(137))"]))
    code = SESSION_PROBE.format(repo=str(REPO), ckpt=SECOND, work=str(tmp_path / "work"), body=body)
    assert lk.python(code, check=False, timeout=180).returncode == 137
    out, log = newest(lk, tmp_path)
    assert out == {"newest": [CKPT, 1, 20], "target": SECOND}
    assert f"notice: version 2 of checkpoint dataset {SECOND} lacks model.safetensors; it is passed over" in log
    assert (live_numbers(lk, CKPT), live_numbers(lk, SECOND)) == ([1], [2])


def test_a_session_publishes_to_the_dataset_the_chain_names_and_resumes_from_the_other(tmp_path, monkeypatch):
    from shared.kaggle.bootstrap import resolve_build
    from shared.kaggle.env import LOCAL_ROOT_ENV
    from shared.kaggle.publish import MANIFEST

    for sub in ("input", "working", "temp"):
        (tmp_path / sub).mkdir()
    monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path))
    mounted = tmp_path / "input" / "run-checkpoints-b"
    mounted.mkdir()
    (mounted / MANIFEST).write_text(json.dumps({"step": 20, "files": {}}))
    build = {"settings": {"out_dir": "{working}/train"},
             "checkpoint_dataset": {"dataset": "alice/run-checkpoints-b", "publish_to": "alice/run-checkpoints",
                                    "resume_setting": "resume_from", "publish": True, "expect_step": 20,
                                    "delete_old_versions": True}}
    lines = []
    built = resolve_build(build, log=lines.append)
    assert (built.publish.dataset, built.publish.input_step, built.publish.delete_old_versions) == (
        "alice/run-checkpoints", 20, True)
    assert "resuming from alice/run-checkpoints-b (step 20)" in lines
