"""Every checkpoint publish is proven by its files (docs/kaggle-api.md, Checkpoint dataset versions): against the
local Kaggle, a blob upload that fails with a 500 no resume cures (kaggle 2.2.4 then creates the version without
that file), and a create over the private-dataset quota that answers "Ok" and lands nothing. A session's publish
is accepted only where its version lists every file of the checkpoint at its size, and publishes again where not,
keeping versions; a deleting publish uploads once (its create deletes the older versions of the checkpoint dataset
it publishes to, the other holding the checkpoint it resumed from: tests/chain/test_publish_turns.py)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from helpers import REPO
from kaggle_fixtures import write_dataset
from test_chain_datasets import CKPT as CHAIN_CKPT  # the chain's probe (tests/chain/test_chain_datasets.py)
from test_chain_datasets import add_version, live_numbers, manifest
from test_chain_datasets import probe as chain_probe

CKPT = "alice/proof-checkpoints"

# Runs in a process whose kaggle client points at the local Kaggle; `out` comes back.
PROBE = """
import contextlib, json, pathlib, sys, time
sys.path.insert(0, {repo!r})
from kaggle.api.kaggle_api_extended import KaggleApi
import shared.kaggle.publish as publish
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
    plan = publish.PublishPlan(CKPT, delete_old_versions=True, verify_s=3.0, poll_s=(0.05, 0.2))
    if {silent}:  # a client that drops a failed file silently (kaggle 2.2.4 without our check)
        publish.failed_uploads_raise = lambda api: contextlib.nullcontext()
    record, lines = {{}}, []
    publish._publish(plan, checkpoint(20), 20, record, lines.append, work_dir=work / "upload")
    out.update(record=record, lines=lines)
"""


def test_a_short_deleting_version_is_published_again_keeping_versions_and_never_a_third_time(
        local_kaggle, tmp_path):
    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.inject("failed_upload", name="model.safetensors", count=1)
    out = probe(lk, tmp_path, PUBLISH.format(silent=True))
    record = out["record"]
    # The deleting version (2) was not proven: the older ones are not counted as deleted.
    assert (record["verified_version"], record["republished"], record["deleted_old_versions"]) == (3, True, False)
    assert live(lk) == [(2, ["checkpoint.json", "optimizer.safetensors"]), (3, WHOLE)]  # 2's create deleted 1
    assert out["lines"][1] == (f"warning: the publish to {CKPT} did not land (version 2 lacks model.safetensors); "
                               "publishing the checkpoint again")
    assert len(out["lines"]) == 2  # no copy of version 3 to delete the older: one upload a create


def test_a_publish_never_proven_whole_is_not_counted_as_deleting(local_kaggle, tmp_path):
    lk = local_kaggle
    start_dataset(lk, tmp_path)
    lk.app.inject("failed_upload", name="optimizer.safetensors", count=2)  # the publish and its second try
    out = probe(lk, tmp_path, PUBLISH.format(silent=True))
    record = out["record"]
    assert (record["verified_version"], record["republished"], record["deleted_old_versions"]) == (None, True, False)
    short = ["checkpoint.json", "model.safetensors"]
    # The deleting create took version 1 at once (the local Kaggle's harsh reading): what the chain resumes from
    # lives in its other checkpoint dataset, never in this one.
    assert live(lk) == [(2, short), (3, short)]


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
    assert (record["verified_version"], record["republished"], record["deleted_old_versions"]) == (2, True, False)
    assert out["lines"][1] == (f"warning: the publish to {CKPT} did not land (no version after 1 appeared); "
                               "publishing the checkpoint again")
    assert live(lk) == [(1, ["README.md"]), (2, WHOLE)]  # the lost create deleted nothing; the second one keeps


# --- the chain's side: a session's version is proven too ---------------------------------------------------------

SESSION = """
    import hashlib
    from pathlib import Path
    weights = b"weights" * 10

    def output(ref, dest, pattern=None, version=0):  # the session's output, as download_output leaves it
        if not {in_output}:
            return []
        folder = Path(dest) / "train" / "checkpoints" / "step_000040"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(weights)
        files = {{"model.safetensors": {{"bytes": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}}}}
        (folder / "checkpoint.json").write_text(json.dumps({{"format": 1, "step": 40, "files": files}}))
        return ["train/checkpoints/step_000040/model.safetensors"]

    client.download_output = output
    record = {{"dataset": CKPT, "step": 40, "start_step": 20, "published": True, "stable_step": None}}
    chain.train.fetch_results = lambda ref, sess: (record, {{}})
    ctx.state.data.update(checkpoint_versions=[1], checkpoint_versions_b=[1, 2])
    # It resumed from version 1 of the first dataset and published to the second, deleting its older versions.
    sess = {{"n": 1, "key": "train-1", "version": 1, "ckpt_ref": CKPT, "ckpt_version": 1, "step_before": 20,
             "publish_ref": CKPT + "-b", "publish_version": 1, "delete_old": True}}
    version, step, info = chain.train.after_session("alice/unit-run-train", sess, CKPT)
    out["after"] = [info["ckpt_ref_after"], version, step]
    out["live"] = [ctx.state.data["checkpoint_versions"], ctx.state.data["checkpoint_versions_b"]]
"""


CHAIN_B = CHAIN_CKPT + "-b"


def short_version(lk, tmp_path: Path) -> None:
    """Version 1 of the first checkpoint dataset holds step 20 whole; the second's version 1 none, its version 2,
    the session's, step 40 without its model file."""
    model = {"model.safetensors": {"bytes": 70, "sha256": "-"}}
    add_version(lk, tmp_path, CHAIN_CKPT, {"checkpoint.json": manifest(20, {"model.safetensors": {"bytes": 5,
                                                                                                  "sha256": "-"}}),
                                           "model.safetensors": "12345"})
    add_version(lk, tmp_path, CHAIN_B, {"README.md": "no checkpoint"})
    add_version(lk, tmp_path, CHAIN_B, {"checkpoint.json": manifest(40, model)})


def test_the_chain_publishes_a_short_session_version_again_from_the_output_once_deleting_only_in_its_dataset(
        local_kaggle, tmp_path):
    lk = local_kaggle
    short_version(lk, tmp_path)
    out, log = chain_probe(lk, tmp_path, SESSION.format(in_output=True))
    assert out == {"after": [CHAIN_B, 3, 40], "live": [[1], [3]]}
    assert "publishing step 40 from the kernel output (version 2 lacks model.safetensors)" in log
    assert "publishing it again, deleting" not in log  # one upload
    assert (live_numbers(lk, CHAIN_CKPT), live_numbers(lk, CHAIN_B)) == ([1], [3])


def test_a_short_session_version_with_no_copy_in_the_output_is_one_line_and_the_chain_resumes_from_the_last_whole(
        local_kaggle, tmp_path):
    lk = local_kaggle
    short_version(lk, tmp_path)
    out, log = chain_probe(lk, tmp_path, SESSION.format(in_output=False))
    assert out == {"after": [CHAIN_CKPT, 1, 20], "live": [[1], [1, 2]]}
    assert (f"warning: version 2 of {CHAIN_B} lacks model.safetensors, and the session's output holds no whole "
            f"copy: step 40 is lost; the next session resumes from version 1 of {CHAIN_CKPT} (step 20)") in log
    assert live_numbers(lk, CHAIN_CKPT) == [1]  # nothing the run needs was deleted


def test_a_publish_given_up_at_its_limit_keeps_its_own_folder_while_the_retry_builds_another(tmp_path):
    """An upload past its time limit runs on in its thread (shared/errors.py `within` cannot stop it): the retry
    (with the key, or the republish) must not rebuild the folder that upload still reads."""
    import threading
    from types import SimpleNamespace

    from shared.kaggle.publish import publish_checkpoint

    ckpt = tmp_path / "step_000010"
    ckpt.mkdir()
    (ckpt / "checkpoint.json").write_text(json.dumps({"format": 1, "step": 10, "files": {}}))
    (ckpt / "model.safetensors").write_bytes(b"weights")
    first_reads, release, seen = threading.Event(), threading.Event(), []

    class SlowThenFast:
        def dataset_status(self, dataset):
            return "ready"

        def dataset_create_version(self, folder, notes, **kw):
            files = sorted(p.name for p in Path(folder).iterdir())
            seen.append((folder, files))
            if len(seen) == 1:  # the hung upload: still reading its folder after the retry has run
                first_reads.set()
                release.wait(30)
                seen.append((folder, sorted(p.name for p in Path(folder).iterdir())))
            return SimpleNamespace(error=None)

    api = SlowThenFast()
    hung = threading.Thread(target=publish_checkpoint, args=(api, ckpt, "alice/run", tmp_path / "work"))
    hung.start()
    assert first_reads.wait(30)
    retry = publish_checkpoint(api, ckpt, "alice/run", tmp_path / "work")
    release.set()
    hung.join(30)
    (first, files), (second, files_again), (still_first, files_after) = seen[0], seen[1], seen[2]
    assert first != second and still_first == first
    assert files == files_again == files_after == ["checkpoint.json", "dataset-metadata.json", "model.safetensors"]
    assert retry["action"] == "versioned" and list((tmp_path / "work").iterdir()) == []  # each folder went with it
