"""Every checkpoint publish is proven by its files (docs/kaggle-api.md, Checkpoint dataset versions): against the
local Kaggle, a blob upload that fails with a 500 no resume cures (kaggle 2.2.4 then creates the version without
that file), and a create over the private-dataset quota that answers "Ok" and lands nothing. A session's publish
is accepted only where its version lists every file of the checkpoint at its size, publishes again where not, and
deletes older versions only once a version is proven whole."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from helpers import REPO
from kaggle_fixtures import write_dataset

CKPT = "alice/proof-checkpoints"

# Runs in a process whose kaggle client points at the local Kaggle; `out` comes back.
PROBE = """
import contextlib, json, pathlib, sys, time
sys.path.insert(0, {repo!r})
from kaggle.api.kaggle_api_extended import KaggleApi
import shared.kaggle.publish as publish
import shared.kaggle.proof as proof
from shared.kaggle.proof import listed_files
api = KaggleApi()
api.authenticate()
CKPT, work = {ckpt!r}, pathlib.Path({work!r})
work.mkdir(parents=True, exist_ok=True)

def checkpoint(step):
    folder = work / f"step_{{step:06d}}"
    folder.mkdir(parents=True, exist_ok=True)
    files = {{"model.safetensors": b"w" * (100 + step), "optimizer.safetensors": b"o" * (200 + step)}}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    manifest = {{"step": step, "files": {{n: {{"bytes": len(d), "sha256": "-"}} for n, d in files.items()}}}}
    (folder / "checkpoint.json").write_text(json.dumps(manifest))
    return folder

out = {{}}
{body}
print("RESULT " + json.dumps(out))
"""


def probe(lk, tmp_path: Path, body: str) -> dict:
    code = PROBE.format(repo=str(REPO), ckpt=CKPT, work=str(tmp_path / "work"), body=textwrap.dedent(body))
    return json.loads(lk.python(code, timeout=180).stdout.splitlines()[-1].removeprefix("RESULT "))


def live(lk) -> list[tuple[int, list[str]]]:
    """(number, file names) of the checkpoint dataset's live versions."""
    return [(v["number"], sorted(f["name"] for f in v["files"]))
            for v in lk.app.state["datasets"][CKPT]["versions"] if not v.get("deleted")]


def start_dataset(lk, tmp_path: Path) -> None:
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", CKPT, {"README.md": "no checkpoint"})))


WHOLE = ["checkpoint.json", "model.safetensors", "optimizer.safetensors"]


def test_a_blob_put_failing_with_500_leaves_the_clients_version_without_that_file_and_our_push_refuses(
        local_kaggle, tmp_path):
    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.inject("failed_upload", name="model.safetensors", count=2)
    out = probe(lk, tmp_path, """
        folder = publish.write_dataset_folder(work / "up", CKPT, "", publish.checkpoint_files(checkpoint(10)))
        reply = api.dataset_create_version(str(folder), "straight through the client", quiet=True)
        out["client"] = [reply.error or "", sorted(listed_files(api, CKPT, 2))]
        try:
            publish.push_dataset_folder(api, folder, CKPT, "through push_dataset_folder")
        except Exception as err:
            out["push"] = f"{type(err).__name__}: {err}"
    """)
    # kaggle 2.2.4: the 500 is not resumed, the upload's token is None, and the version is made without the file.
    assert out["client"] == ["", ["checkpoint.json", "optimizer.safetensors"]]
    assert out["push"] == "UploadFailed: the upload of model.safetensors failed; no version was created without it"
    assert [n for n, _ in live(lk)] == [1, 2] and lk.app.faults.failed_uploads == []


def test_a_create_over_the_private_dataset_quota_answers_ok_and_lands_nothing(local_kaggle, tmp_path):
    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.settings.private_dataset_quota_bytes = 300  # the README fits; a checkpoint of 300+ bytes does not
    out = probe(lk, tmp_path, """
        folder = publish.write_dataset_folder(work / "up", CKPT, "", publish.checkpoint_files(checkpoint(10)))
        out["action"] = publish.push_dataset_folder(api, folder, CKPT, "over the quota", delete_old_versions=True)
    """)
    assert out["action"] == "versioned"  # no error: "Ok"
    assert [n for n, _ in live(lk)] == [1]  # nothing landed, and nothing was deleted


PUBLISH = """
    plan = publish.PublishPlan(CKPT, delete_old_versions=True, verify_s=5.0)
    if {silent}:  # a client that drops a failed file silently (kaggle 2.2.4 without our check)
        publish.failed_uploads_raise = lambda api: contextlib.nullcontext()
    record, lines = {{}}, []
    proof.VERSION_POLL_S = 0.05  # poll the local Kaggle quickly
    publish._publish(plan, checkpoint(20), 20, record, lines.append, work_dir=work / "upload")
    out.update(record=record, lines=lines)
"""


def test_a_short_version_is_published_again_and_older_versions_go_only_after_one_is_proven_whole(
        local_kaggle, tmp_path):
    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.inject("failed_upload", name="model.safetensors", count=1)
    out = probe(lk, tmp_path, PUBLISH.format(silent=True))
    record = out["record"]
    assert (record["verified_version"], record["republished"], record["deleted_old_versions"]) == (4, True, True)
    assert live(lk) == [(4, WHOLE)]  # version 2 (short) and 3 (whole, proven) went with the deleting version 4
    assert out["lines"][1] == (f"warning: the publish to {CKPT} did not land (version 2 lacks model.safetensors); "
                               "publishing the checkpoint again")
    assert out["lines"][2] == f"publish: version 3 of {CKPT} is whole; publishing it again, deleting the older versions"


def test_a_publish_never_proven_whole_deletes_nothing(local_kaggle, tmp_path):
    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.inject("failed_upload", name="optimizer.safetensors", count=2)  # the publish and its second try
    out = probe(lk, tmp_path, PUBLISH.format(silent=True))
    record = out["record"]
    assert (record["verified_version"], record["republished"], record["deleted_old_versions"]) == (None, True, False)
    short = ["checkpoint.json", "model.safetensors"]
    assert live(lk) == [(1, ["README.md"]), (2, short), (3, short)]  # version 1 is still there


def test_a_failed_upload_through_our_client_raises_before_any_version(local_kaggle, tmp_path):
    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.inject("failed_upload", name="model.safetensors", count=1)
    body = "try:\n" + textwrap.indent(textwrap.dedent(PUBLISH.format(silent=False)), "    ") + \
        "except Exception as err:\n    out['error'] = f'{type(err).__name__}: {err}'\n"
    out = probe(lk, tmp_path, body)
    assert out["error"] == "UploadFailed: the upload of model.safetensors failed; no version was created without it"
    assert [n for n, _ in live(lk)] == [1]


def test_a_quota_create_that_lands_nothing_is_not_accepted(local_kaggle, tmp_path):
    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.inject("lost_publish", dataset=CKPT, count=1)
    out = probe(lk, tmp_path, PUBLISH.format(silent=False))
    record = out["record"]
    assert (record["verified_version"], record["republished"], record["deleted_old_versions"]) == (3, True, True)
    assert out["lines"][1] == (f"warning: the publish to {CKPT} did not land (no version after 1 appeared); "
                               "publishing the checkpoint again")
    assert live(lk) == [(3, WHOLE)]
