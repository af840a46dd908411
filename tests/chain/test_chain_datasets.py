"""The checkpoint dataset's versions against the local Kaggle (docs/kaggle-api.md, Checkpoint dataset versions):
a status that still describes the previous version is waited out and the new version's step read from exactly that
version; a publish that reports success but never appears is caught; versions beyond keep_dataset_versions are
deleted; a session whose mount shows an older version fetches the expected one with kagglehub, or stops in one line;
and a chain meeting all of it resumes each session from the step it expects."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from helpers import REPO, error_lines
from kaggle_fixtures import KEY, USER, save_without_running, write_dataset, write_kernel

CKPT = "alice/unit-run-checkpoints"
CONFIG = {"name": "unit-run", "token_datasets": ["alice/tokens"], "poll_initial_s": 0.05, "poll_max_s": 0.2,
          "retry_attempts": 2, "retry_base_s": 0.1}


def manifest(step: int, files: dict | None = None) -> str:
    return json.dumps({"format": 1, "step": step, "files": files or {}})


def add_version(lk, tmp_path: Path, ref: str, files: dict) -> None:
    """A new version of `ref` (the dataset created on first use) through the real kaggle CLI."""
    folder = write_dataset(tmp_path / ref.replace("/", "_"), ref, files)
    live = lk.app.state["datasets"].get(ref)
    if live is None:
        lk.cli("datasets", "create", "-p", str(folder))
    else:
        lk.cli("datasets", "version", "-p", str(folder), "-m", "a version")


def live_numbers(lk, ref: str) -> list[int]:
    return [v["number"] for v in lk.app.state["datasets"][ref]["versions"] if not v.get("deleted")]


PROBE = """
import json, sys
sys.path.insert(0, {repo!r})  # scripts/ is not installed: the checkout's
from scripts.chain.chain import Chain
from scripts.chain.config import config_from_dict
from scripts.chain.checkpoints import (dataset_head, dataset_step, note_version, session_publishes,
                                       wait_published, ensure_checkpoint_dataset, check_version_step)
from shared.errors import UserError
from shared.kaggle.publish import push_dataset_folder, write_dataset_folder
chain = Chain(config_from_dict({config}), {work!r})
chain.connect()
chain.client.dataset_wait_s = {wait_s}
ctx, client, CKPT = chain.ctx, chain.client, {ckpt!r}
out = {{}}
{body}
print("RESULT " + json.dumps(out))
"""


def probe(lk, tmp_path: Path, body: str, wait_s: float = 30.0, **config) -> tuple[dict, str]:
    """Run `body` with a connected chain (`chain`, `ctx`, `client`) in a process that the real kaggle client points
    at the local Kaggle; (what it put in `out`, the chain's log)."""
    code = PROBE.format(repo=str(REPO), config=json.dumps({**CONFIG, **config}), work=str(tmp_path / "chain"),
                        wait_s=wait_s, ckpt=CKPT, body=textwrap.dedent(body))
    lines = lk.python(code, timeout=180).stdout.splitlines()
    return json.loads(lines[-1].removeprefix("RESULT ")), "\n".join(lines[:-1])


# --- the chain's side ------------------------------------------------------------------------------------------

def test_a_stale_dataset_status_after_a_publish_is_waited_out_and_the_new_version_is_read(local_kaggle, tmp_path):
    lk = local_kaggle
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(10)})
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(20)})
    # Four calls that name no version still describe version 1: what the chain read after a publish until now.
    lk.app.inject("stale_dataset_status", dataset=CKPT, count=4)
    out, _ = probe(lk, tmp_path, """
        out["newest_manifest_step"] = dataset_step(ctx, CKPT)
        out["status"] = client.dataset_version(CKPT)
        out["waited_for"] = client.wait_dataset_version(CKPT, 1)
        out["step"] = dataset_step(ctx, CKPT, out["waited_for"])
    """)
    assert out == {"newest_manifest_step": 10, "status": [1, "ready"], "waited_for": 2, "step": 20}
    assert lk.app.faults.datasets["stale_dataset_status"] == []  # every stale answer was read


def test_a_404_on_a_ready_versions_manifest_is_tried_again_and_never_read_as_no_checkpoint(local_kaggle, tmp_path):
    lk = local_kaggle
    add_version(lk, tmp_path, CKPT, {"README.md": "no checkpoint yet"})
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(20)})
    lk.app.inject("http", match="DownloadDataset", status=404, count=2)  # two 404s on a manifest that is there
    body = """
        import scripts.chain.checkpoints as checkpoints
        checkpoints.MANIFEST_404_WAIT_S = 0.01
        out["v2"] = dataset_step(ctx, CKPT, 2)
        out["v1"] = dataset_step(ctx, CKPT, 1)  # lists no manifest: none, at once
    """
    out, log = probe(lk, tmp_path, body)
    assert out == {"v2": 20, "v1": 0}
    assert log.count("lists checkpoint.json, but its download answered 404; trying again") == 2
    # A listing that lags (no files yet: a version is never empty) is no "no checkpoint" either.
    lk.app.inject("http", match="DownloadDataset", status=404, count=1)
    out, log = probe(lk, tmp_path, """
        import scripts.chain.checkpoints as checkpoints
        checkpoints.MANIFEST_404_WAIT_S = 0.01
        listed = checkpoints.version_files
        calls = []

        def lagging(ctx, ref, version):
            calls.append(version)
            return set() if len(calls) == 1 else listed(ctx, ref, version)

        checkpoints.version_files = lagging
        out["v2"] = dataset_step(ctx, CKPT, 2)
    """)
    assert out == {"v2": 20}
    assert log.count("version 2 of " + CKPT + " lists no files yet, but its download answered 404; trying again") == 1
    lk.app.inject("http", match="DownloadDataset", status=404, count=100)
    out, log = probe(lk, tmp_path, """
        import scripts.chain.checkpoints as checkpoints
        checkpoints.MANIFEST_404_WAIT_S = 0.01
        try:
            dataset_step(ctx, CKPT, 2)
        except UserError as err:
            out["error"] = str(err)
    """)
    assert out["error"] == (f"dataset {CKPT}: version 2 lists checkpoint.json, but 4 downloads of its checkpoint.json "
                            "answered 404; not reading that as 'no checkpoint': run the chain again later")


SESSION_OUTPUT = """
import hashlib, json
from pathlib import Path
step, weights, record = {step!r}, {weights!r}, {record!r}
folder = Path(f"train/checkpoints/step_{{step:06d}}")
folder.mkdir(parents=True)
(folder / "model.safetensors").write_bytes(weights)
files = {{"model.safetensors": {{"bytes": len(weights), "sha256": hashlib.sha256(weights).hexdigest()}}}}
(folder / "checkpoint.json").write_text(json.dumps({{"format": 1, "step": step, "files": files}}))
Path("publish.json").write_text(json.dumps(record))
"""


def session_output(saved_step: int, weights: bytes, **record) -> str:
    """A session's code that leaves checkpoint `saved_step` (its one file holding `weights`) in its output and
    `record` as its publish.json."""
    return SESSION_OUTPUT.format(step=saved_step, weights=weights, record={"dataset": CKPT, **record})


@pytest.mark.slow
def test_a_publish_that_reports_success_but_never_appears_is_caught(local_kaggle, tmp_path):
    lk = local_kaggle
    add_version(lk, tmp_path, CKPT, {"README.md": "no checkpoint yet"})
    # A session that says it published step 40 (Kaggle answered "Ok"), with nothing new on the dataset.
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "k", "alice/unit-run-train",
                                                      session_output(40, b"weights" * 10, step=40, published=True))))
    assert lk.wait("alice/unit-run-train") == ("COMPLETE", None)
    lk.app.inject("lost_publish", dataset=CKPT, count=1)  # and the chain's own publish is answered "Ok" too
    out, log = probe(lk, tmp_path, """
        sess = {"n": 1, "key": "train-1", "version": 1, "ckpt_version": 1, "step_before": 0, "delete_old": False}
        try:
            chain.train.after_session("alice/unit-run-train", sess, CKPT)
        except UserError as err:
            out["error"] = str(err)
        out["again"] = chain.train.after_session("alice/unit-run-train", sess, CKPT)
    """, wait_s=2)
    assert ("warning: the session's publish of step 40 reported success, but no version of "
            f"{CKPT} after version 1 was ready within 2 s (Kaggle shows version 1, ready)") in log
    assert out["error"] == (
        f"the chain's publish of step 40 to {CKPT} reported success, but no version of {CKPT} after version 1 was "
        "ready within 2 s (Kaggle shows version 1, ready); a create over the private-dataset quota is answered so "
        "(kaggle-cli issue 284): free space on Kaggle (or lower keep_dataset_versions), then run the chain again")
    version, step, info = out["again"]  # the quota freed: the chain's publish lands and is read back
    assert (version, step, info["published_by"], info["ckpt_version_after"]) == (2, 40, "chain", 2)
    assert [v["notes"] for v in lk.app.state["datasets"][CKPT]["versions"]] == [
        "Initial release", "checkpoint at step 40 (published by the chain)"]




def test_an_extending_session_it_must_publish_goes_out_with_the_carried_stable_phase_checkpoint(local_kaggle,
                                                                                                tmp_path):
    """The dataset holds step 40 (a finished, decayed run) and its stable-phase checkpoint, step 30. A session
    extending from 30 to 35 could not publish: the chain publishes 35 from its output, with step 30 carried
    over from the version before, and counts its progress from 30. One that trained nothing made none."""
    import hashlib

    lk = local_kaggle
    stable = b"stable" * 10
    stable_manifest = {"format": 1, "step": 30, "files": {
        "model.safetensors": {"bytes": len(stable), "sha256": hashlib.sha256(stable).hexdigest()}}}
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(40), "stable__checkpoint.json":
                                     json.dumps(stable_manifest), "stable__model.safetensors": stable})
    for n, step in ((1, 35), (2, 30)):
        ref = f"alice/unit-run-train{n}"
        code = session_output(35, b"extended" * 10, step=step, start_step=30, published=False, reason="no secrets")
        lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / f"k{n}", ref, code)))
        assert lk.wait(ref) == ("COMPLETE", None)
    out, log = probe(lk, tmp_path, """
        from scripts.chain.train_stage import start_of
        for n in (2, 1):  # each the first session after the finished run
            sess = {"n": n, "key": f"train-{n}", "version": 1, "ckpt_version": 1, "step_before": 40}
            version, step, info = chain.train.after_session(f"alice/unit-run-train{n}", sess, CKPT)
            sess.update(info, step_after=step)
            out[n] = [version, step, info.get("published_by"), start_of(sess)]
    """)
    assert out == {"1": [2, 35, "chain", 30], "2": [1, 40, None, 40]}  # 35 > 30: progress; 40 > 40: none
    assert "publishing step 35 with the stable phase's step_000030 from the kernel output (no secrets)" in log
    (_, newest) = lk.app.state["datasets"][CKPT]["versions"]
    folder = lk.root / "datasets" / "alice" / CKPT.split("/")[1] / str(newest["number"])
    assert sorted(p.name for p in folder.iterdir()) == [
        "checkpoint.json", "model.safetensors", "stable__checkpoint.json", "stable__model.safetensors"]
    assert (folder / "stable__model.safetensors").read_bytes() == stable
    assert (folder / "model.safetensors").read_bytes() == b"extended" * 10


def test_train_extend_is_checked_against_the_dataset_before_any_session(local_kaggle, tmp_path):
    """The dataset holds a finished 4-step wsd run (step 4) and its stable-phase checkpoint (step 3): extended to 8
    steps, the next session will resume from 3 (said once); with a decay that would start before step 3, neither
    agrees, and that is one line before anything is pushed (the session would stop at its start)."""
    lk = local_kaggle
    # carried as a checkpoint written before the rename carries it (max_steps, now total_steps)
    saved = {"schedule": "wsd", "max_steps": 4, "warmup_steps": 1, "cooldown_frac": 0.5}
    add_version(lk, tmp_path, CKPT, {
        "checkpoint.json": manifest(4), "state.json": json.dumps({"step": 4, "config": {"train": saved}}),
        "stable__checkpoint.json": manifest(3),
        "stable__state.json": json.dumps({"step": 3, "config": {"train": saved}})})
    train = {"preset": "tiny", "seq_len": 32, "micro_batch": 8, "total_batch_tokens": 256, "schedule": "wsd",
             "warmup_steps": 1, "cooldown_frac": 0.5}
    out, log = probe(lk, tmp_path, """
        chain.cfg = chain.ctx.cfg = chain.train.cfg = chain.cfg.with_train(extend=True)  # (written as Python)
        out["work"] = chain.train.check_work_left()
        chain.train.check_work_left()
        chain.cfg = chain.ctx.cfg = chain.train.cfg = chain.cfg.with_train(cooldown_frac=0.9)
        try:
            chain.train.check_work_left()
        except UserError as err:
            out["error"] = str(err)
    """, total_steps=8, train=train)
    assert out["work"] == [1, 4]
    assert log.count("train.extend:") == 1 and (
        f"train.extend: the next session trains on from step 3, where the stable phase ended (version 1 of {CKPT} "
        "carries it beside step 4)") in log
    assert out["error"] == (
        f"train.extend: no checkpoint in version 1 of {CKPT} agrees with total_steps 8 (step 4 of a 4-step wsd "
        "schedule; step 3 of a 4-step wsd schedule): its decay must start after the stable phase the run kept "
        "(docs/recipe.md section 6)")


@pytest.mark.parametrize(("keep", "deleted", "live"), [
    (2, [False, True, False, True], [5]),
    (1, [True, True, True, True], [5]),
    (0, [False, False, False, False], [1, 2, 3, 4, 5]),
])
def test_versions_beyond_keep_dataset_versions_are_deleted(local_kaggle, tmp_path, keep, deleted, live):
    """Kaggle deletes only every older version at once (deleteOldVersions): the publish that would leave more than
    keep_dataset_versions sends it, so no more than that many stay, and each version verifies before it counts."""
    lk = local_kaggle
    out, _ = probe(lk, tmp_path, """
        ensure_checkpoint_dataset(ctx, CKPT)
        out["deleted"], out["known"] = [], []
        for step in (10, 20, 30, 40):
            before = dataset_head(ctx, CKPT)[0]
            delete, _ = session_publishes(ctx, before, 1800)  # sessions too short to publish midway
            (ctx.workdir / "checkpoint.json").write_text(json.dumps({"format": 1, "step": step, "files": {}}))
            folder = write_dataset_folder(ctx.workdir / "up", CKPT, "run", [ctx.workdir / "checkpoint.json"])
            push_dataset_folder(client.api, folder, CKPT, f"checkpoint at step {step}", delete)
            version = wait_published(ctx, CKPT, before, f"publish of step {step}")
            check_version_step(ctx, CKPT, version, step)
            note_version(ctx, version, delete)
            out["deleted"].append(delete)
            out["known"].append(list(ctx.state.data["checkpoint_versions"]))
        out["head"] = dataset_head(ctx, CKPT)
    """, keep_dataset_versions=keep)
    assert out["deleted"] == deleted
    assert out["known"][-1] == live_numbers(lk, CKPT) == live
    assert max(len(k) for k in out["known"]) == (keep or 5)
    assert out["head"] == [5, 40]


def test_keep_dataset_versions_must_be_a_whole_number():
    from scripts.chain.config import config_from_dict
    from shared.errors import UserError

    assert config_from_dict({"token_datasets": ["a/b"]}).keep_dataset_versions == 2
    with pytest.raises(UserError, match=r"^config: keep_dataset_versions must be a whole number >= 0, got -1$"):
        config_from_dict({"token_datasets": ["a/b"], "keep_dataset_versions": -1})


# --- the session's side: a mount of an older version ----------------------------------------------------------

RESUME_KERNEL = """
import json
from pathlib import Path
from shared.errors import run_cli
from shared.kaggle.bootstrap import resolve_build
build = json.loads(%r)
settings = run_cli(lambda: resolve_build(build)).settings
staged = next(Path(settings["resume_from"]).glob("step_*"))
print("STAGED", staged.name, (staged / "model.safetensors").read_text())
"""


def resume_kernel(lk, folder: Path, expect_step: int, expect_version: int) -> str:
    """Run a kernel that stages the checkpoint dataset as the train kernel does (the chain's expectation baked in),
    with the owner's credentials attached; returns its log."""
    ref = "alice/unit-run-train"
    build = {"kernel": "train", "accelerator": "", "settings": {"out_dir": "{working}/train"},
             "checkpoint_dataset": {"dataset": CKPT, "resume_setting": "resume_from", "expect_step": expect_step,
                                    "expect_version": expect_version}}
    write_kernel(folder, ref, RESUME_KERNEL % json.dumps(build), enable_internet=True, dataset_sources=[CKPT])
    if ref not in lk.app.state["kernels"]:
        save_without_running(lk, folder)
        lk.app.attach_secret(ref, "KAGGLE_USERNAME", USER)
        lk.app.attach_secret(ref, "KAGGLE_KEY", KEY)
    lk.cli("kernels", "push", "-p", str(folder))
    lk.wait(ref, timeout=120)
    versions = lk.app.state["kernels"][ref]["versions"]
    return "".join(e["data"] for e in lk.app.kernels.log_events(lk.app.state["kernels"][ref], versions[-1]["number"]))


@pytest.mark.slow
def test_a_session_mounting_an_older_version_fetches_the_expected_one_or_stops_in_one_line(local_kaggle, tmp_path):
    lk = local_kaggle
    for step in (10, 20):
        add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(step), "model.safetensors": f"weights {step}"})
    lk.app.inject("stale_mount", dataset=CKPT, count=2)  # both sessions below mount version 1 (step 10)
    log = resume_kernel(lk, tmp_path / "k", expect_step=20, expect_version=2)
    mount = lk.root / "kernels" / "alice" / "unit-run-train" / "2" / "kaggle" / "input" / "unit-run-checkpoints"
    assert (f"notice: checkpoint dataset {CKPT} holds step 20, but this session sees step 10 in {mount} (an older "
            "version); fetching version 2 with kagglehub") in log
    assert f"resuming from {CKPT} (step 20)" in log and "STAGED step_000020 weights 20" in log
    assert lk.app.state["kernels"]["alice/unit-run-train"]["versions"][-1]["status"] == "COMPLETE"

    # A version that cannot be had: one error line before any training, and nothing resumed.
    log = resume_kernel(lk, tmp_path / "k", expect_step=20, expect_version=7)
    version = lk.app.state["kernels"]["alice/unit-run-train"]["versions"][-1]
    assert (version["status"], version["failure_message"]) == ("ERROR", "Kernel process exited with code 2")
    (line,) = error_lines(log)
    mount = mount.parents[3] / "3" / "kaggle" / "input" / "unit-run-checkpoints"
    assert line == (f"error: checkpoint dataset {CKPT} holds step 20, but this session sees step 10 in {mount}, and "
                    f"version 7 could not be fetched (HTTP 404: Dataset '{CKPT}' has no version 7); not starting over")
    assert KEY not in log and "resuming from" not in log

    # What kagglehub does in a notebook with its cache resolver on: attach, which a batch session is refused.
    folder = write_kernel(tmp_path / "attach", "alice/unit-run-train", ATTACH_KERNEL % f"{CKPT}/versions/2",
                          enable_internet=True)
    lk.cli("kernels", "push", "-p", str(folder))
    lk.wait("alice/unit-run-train", timeout=120)
    versions = lk.app.state["kernels"]["alice/unit-run-train"]["versions"]
    log = "".join(e["data"] for e in lk.app.kernels.log_events(lk.app.state["kernels"]["alice/unit-run-train"],
                                                                 versions[-1]["number"]))
    assert "ATTACH HTTPError 403" in log and "attaching a datasource is refused in a batch session" in log


@pytest.mark.slow
def test_a_stale_mount_at_a_higher_step_is_fetched_in_a_session_on_the_local_kaggle(local_kaggle, tmp_path):
    """An extension's first version (step 15, trained on from the stable phase) is newer than the run's end (step
    20). The local Kaggle mounts the version before it, at the higher step: the session fetches the chain's."""
    lk = local_kaggle
    for step in (20, 15):
        add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(step), "model.safetensors": f"weights {step}"})
    lk.app.inject("stale_mount", dataset=CKPT, count=1)
    log = resume_kernel(lk, tmp_path / "k", expect_step=15, expect_version=2)
    assert f"notice: checkpoint dataset {CKPT} holds step 15, but this session sees step 20 in " in log
    assert ("(another version: one the chain did not accept, or the run's end before --extend trained on below it); "
            "fetching version 2 with kagglehub") in log
    assert f"resuming from {CKPT} (step 15)" in log and "STAGED step_000015 weights 15" in log


ATTACH_KERNEL = """
import kagglehub
try:
    kagglehub.dataset_download(%r)
except Exception as err:
    print("ATTACH", type(err).__name__, getattr(getattr(err, "response", None), "status_code", None),
          getattr(getattr(err, "response", None), "text", ""))
"""


def test_a_fetch_that_never_answers_stops_in_one_line(monkeypatch, tmp_path):
    """kagglehub's attach in a Kaggle notebook waits for its mount without a limit: the session stops instead of
    spending itself on it."""
    import sys
    import threading
    from types import SimpleNamespace

    from shared.errors import UserError
    from shared.kaggle import bootstrap

    hung = threading.Event()
    kagglehub = SimpleNamespace(dataset_download=lambda handle, output_dir: hung.wait())
    monkeypatch.setitem(sys.modules, "kagglehub", kagglehub)
    monkeypatch.setattr(bootstrap, "FETCH_TIMEOUT_S", 0.2)
    with pytest.raises(UserError) as err:
        bootstrap.fetch_dataset_version(CKPT, 2, tmp_path / "fetch")
    hung.set()
    assert str(err.value) == "no answer within 0.2 s"



def test_a_fetch_may_take_only_what_is_left_of_the_sessions_deadline(monkeypatch, tmp_path):
    """The session's deadline counts from its process's start: a fetch that would run past it stops there in one
    line (the chain pushes again) instead of leaving no time to train and publish before Kaggle's kill."""
    import sys
    import threading
    import time
    from types import SimpleNamespace

    from shared.errors import UserError
    from shared.kaggle import bootstrap
    from shared.session_clock import process_start

    hung, asked = threading.Event(), []
    kagglehub = SimpleNamespace(dataset_download=lambda handle, output_dir: asked.append(handle) or hung.wait())
    monkeypatch.setitem(sys.modules, "kagglehub", kagglehub)
    paths, lines = SimpleNamespace(temp=tmp_path), []
    ckpt = {"dataset": CKPT, "expect_step": 40, "expect_version": 3}
    age = time.monotonic() - process_start()
    stale = f"checkpoint dataset {CKPT} holds step 40, but this session finds no checkpoint in its inputs"
    began = time.monotonic()
    with pytest.raises(UserError) as err:
        bootstrap._fetch_expected(ckpt, None, None, paths, lines.append, session_deadline=age + 1.0)
    waited = time.monotonic() - began
    hung.set()
    assert asked == [f"{CKPT}/versions/3"] and 0.5 < waited < 30
    (notice,) = lines
    assert notice.startswith(f"notice: {stale} (an older version); fetching version 3 with kagglehub, for at most ")
    assert notice.endswith(" s (what is left of the session's deadline)")
    assert 0.5 < float(notice.split("for at most ")[1].split(" s ")[0]) <= 1.0
    assert str(err.value).startswith(f"{stale}, and version 3 could not be fetched (no answer within ")
    assert str(err.value).endswith(" s (what is left of the session's deadline)); not starting over")
    # Past the deadline already: no fetch at all. With no deadline (a local run): FETCH_TIMEOUT_S, as before.
    with pytest.raises(UserError, match=r"the session's deadline \(5 s from its start\) has passed before the fetch"):
        bootstrap._fetch_expected(ckpt, None, None, paths, lines.append, session_deadline=5.0)
    assert asked == [f"{CKPT}/versions/3"]
    monkeypatch.setattr(bootstrap, "FETCH_TIMEOUT_S", 0.2)
    hung_again = threading.Event()
    monkeypatch.setitem(sys.modules, "kagglehub",
                        SimpleNamespace(dataset_download=lambda handle, output_dir: hung_again.wait()))
    with pytest.raises(UserError, match=r"could not be fetched \(no answer within 0.2 s\); not starting over"):
        bootstrap._fetch_expected(ckpt, None, None, paths, lines.append)
    hung_again.set()


@pytest.mark.parametrize("extend", [True, False])
def test_a_stale_mount_at_a_higher_step_is_fetched_not_trained_past(monkeypatch, tmp_path, extend):
    """An extension trains on from its stable phase, below the run's end: its first publish (step 30) is newer than
    the version before it (step 40). A stale mount of that older version shows the higher step; with --extend the
    trainer would pass it over and train from the stable phase again. Without --extend a higher step than the chain
    accepted is a version it refused (one short of a file). Either way the session fetches the chain's version."""
    import sys
    from types import SimpleNamespace

    from shared.kaggle import bootstrap

    def flat_checkpoint(folder: Path, step: int) -> Path:
        folder.mkdir(parents=True)
        (folder / "checkpoint.json").write_text(manifest(step))
        (folder / "model.safetensors").write_text(f"weights {step}")
        return folder

    mounted = flat_checkpoint(tmp_path / "input" / "unit-run-checkpoints", 40)
    asked = []

    def download(handle: str, output_dir: str) -> str:
        asked.append(handle)
        return str(flat_checkpoint(Path(output_dir), 30))

    monkeypatch.setitem(sys.modules, "kagglehub", SimpleNamespace(dataset_download=download))
    paths = SimpleNamespace(temp=tmp_path / "temp", input_dir=lambda slug: mounted)
    settings, lines = {"extend": extend}, []
    ckpt = {"dataset": CKPT, "resume_setting": "resume_from", "expect_step": 30, "expect_version": 5}
    step = bootstrap._stage_resume(ckpt, settings, paths, lines.append)
    staged = {p.name: (p / "model.safetensors").read_text() for p in Path(settings["resume_from"]).glob("step_*")}
    assert asked == [f"{CKPT}/versions/5"] and step == 30 and staged == {"step_000030": "weights 30"}
    assert lines[0].startswith(f"notice: checkpoint dataset {CKPT} holds step 30, but this session sees step 40 in "
                               f"{mounted} (another version: one the chain did not accept, or the run's end before "
                               "--extend trained on below it); fetching version 5 ")
    assert lines[-1] == f"resuming from {CKPT} (step 30)"


def test_a_first_version_the_chain_refused_is_not_resumed_from(tmp_path):
    """The first session's version came out short and the chain gave it up (no copy anywhere): the chain expects
    the placeholder (step 0) again. The next session's mount shows that short version; it trains from step 0."""
    from types import SimpleNamespace

    from shared.kaggle import bootstrap

    mounted = tmp_path / "input" / "unit-run-checkpoints"
    mounted.mkdir(parents=True)
    (mounted / "checkpoint.json").write_text(manifest(40))  # its model file never landed
    paths = SimpleNamespace(temp=tmp_path / "temp", input_dir=lambda slug: mounted)
    settings, lines = {}, []
    ckpt = {"dataset": CKPT, "resume_setting": "resume_from", "expect_step": 0, "expect_version": 1}
    assert bootstrap._stage_resume(ckpt, settings, paths, lines.append) is None
    assert "resume_from" not in settings
    assert lines == [f"notice: checkpoint dataset {CKPT} holds no checkpoint the chain accepted; step 40 in "
                     f"{mounted} is not one; training from step 0"]
    # A build without the chain's expectation (a kernel run by hand) resumes from what it mounts, as before.
    settings, lines = {}, []
    assert bootstrap._stage_resume({**ckpt, "expect_version": 0}, settings, paths, lines.append) == 40


# --- a chain --------------------------------------------------------------------------------------------------

def upload_tokens(lk, tmp_path: Path, ref: str, folder: Path) -> None:
    files = {f.name: f.read_bytes() for f in folder.glob("*.bin")}
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "tokens", ref, files)))


@pytest.mark.slow
def test_a_finished_wsd_chain_extends_from_its_stable_phase_checkpoint_carried_in_the_dataset(
        local_kaggle, tmp_path, demo_data, image_pythons):
    """A 4-step wsd run finishes (its stable phase ends at step 3, published beside step 4); run again with
    total_steps 8 and train.extend, the chain trains on from step 3 (not 4, which decayed), counts that session's
    progress from 3, and the next session resumes from 6 and carries the new stable-phase checkpoint (step 5, made
    by the session before) into the final version.

    Each session resumes from the version the chain expects, whatever the dataset answers: after session 1's
    publish the dataset's status still shows version 1 for a while (no second publish, no false "no progress");
    session 2 mounts the placeholder version (a stale mount) and fetches version 2. The sessions publish to the two
    checkpoint datasets in turn (session 2 to the second, session 3 to the first again, whose older versions its
    one create deletes: keep_dataset_versions 2). No secret is attached: each session publishes with its own
    notebook token."""
    from test_chain import DEMO, first_contact, run_chain, session_log, write_config

    lk = local_kaggle
    upload_tokens(lk, tmp_path, "alice/ext-tokens", demo_data)
    ckpt, work = "alice/ext-run-checkpoints", tmp_path / "w"
    # evals only at the key steps (each session's start, the stable phase's end, the last step): the projection
    train = {**DEMO["train"], "micro_batch": 8, "schedule": "wsd", "warmup_steps": 1, "cooldown_frac": 0.5,
             "eval_every": 1000, "eval_batches": 2}
    # 40 s to publish: two checkpoints of 82 MB at the assumed 10 MB/s, once, with room to spare (the demo's 20 s is
    # one checkpoint's).
    common = dict(name="ext-run", tokenize={}, eval={"enabled": False}, token_datasets=["alice/ext-tokens"],
                  session_limit_s=300, publish_margin_s=40)

    def dataset_steps() -> tuple[int, int | None]:
        """(checkpoint step, stable-phase checkpoint step) of the dataset's newest version."""
        number = lk.app.state["datasets"][ckpt]["versions"][-1]["number"]
        folder = lk.root / "datasets" / "alice" / "ext-run-checkpoints" / str(number)
        stable = folder / "stable__checkpoint.json"
        return (json.loads((folder / "checkpoint.json").read_text())["step"],
                json.loads(stable.read_text())["step"] if stable.exists() else None)

    config = write_config(tmp_path / "ext.json", total_steps=4, train=train, **common)
    first_contact(lk, config, work, attach=False)  # the sessions publish with their own notebook tokens
    lk.app.inject("stale_dataset_status", dataset=ckpt, count=6)  # the calls right after session 1's publish
    proc = run_chain(lk, config, work, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert dataset_steps() == (4, 3)
    assert "projection at the stable phase's end (step 3): final val loss " in proc.stdout  # a tiny model: behind
    assert lk.app.faults.datasets["stale_dataset_status"] == []  # all read, and not taken for a lost publish

    config = write_config(tmp_path / "ext.json", total_steps=8, train={**train, "extend": True, "stop_after_steps": 3},
                          **common)
    lk.app.inject("stale_mount", dataset=ckpt, count=1)  # the first session with two versions to choose from
    proc = run_chain(lk, config, work, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert ("chain ext-run finished at step 4; training on to total_steps 8 (train.extend: from where the stable "
            "phase ended)") in proc.stdout
    assert "step 3 (--extend: from where the stable phase ended) -> 6 of 8" in proc.stdout
    assert "projection at the stable phase's end (step 5): final val loss " in proc.stdout  # the longer run's
    assert "stopping:" not in proc.stdout
    sessions = json.loads((work / "state.json").read_text())["train_sessions"]
    assert [(s["step_before"], s.get("start_step"), s["step_after"], s["ckpt_version"], s["delete_old"],
             s.get("published_by")) for s in sessions] == [
        (0, None, 4, 1, False, "session"), (4, 3, 6, 2, False, "session"), (6, None, 8, 2, True, "session")]
    second = ckpt + "-b"
    assert [(s["ckpt_ref"], s["publish_ref"]) for s in sessions[1:]] == [(ckpt, second), (second, ckpt)]
    log = session_log(work / "sessions" / "train-02")
    assert "(an older version); fetching version 2 with kagglehub" in log
    assert lk.app.accounts.secrets_of("alice/ext-run-train") == {}
    for n, to in ((1, ckpt), (2, second), (3, ckpt)):
        assert f"publishing to {to} with the notebook's token" in session_log(work / "sessions" / f"train-{n:02d}")
    assert f"resuming from {ckpt} (step 4)" in log and "--extend: training on from step 3" in log
    assert f"resuming from {second} (step 6)" in session_log(work / "sessions" / "train-03")
    assert dataset_steps() == (8, 5)
    versions = lk.app.state["datasets"][ckpt]["versions"]
    assert [(v["notes"], bool(v.get("deleted"))) for v in versions] == [
        ("Initial release", True), ("checkpoint at step 4", True), ("checkpoint at step 8", False)]  # one upload
    assert [(v["notes"], bool(v.get("deleted"))) for v in lk.app.state["datasets"][second]["versions"]] == [
        ("Initial release", False), ("checkpoint at step 6", False)]  # what session 3 resumed from, kept
    state = json.loads((work / "state.json").read_text())
    assert (state["checkpoint_versions"], state["checkpoint_versions_b"]) == ([3], [1, 2])
    assert lk.app.faults.datasets == {"stale_dataset_status": [], "stale_mount": [], "lost_publish": []}


def test_a_checkpoint_kept_only_in_temp_deletes_older_versions_and_its_session_verifies_its_publish(local_kaggle,
                                                                                                      tmp_path):
    """gpt2-large/xl keep their checkpoint in /kaggle/temp (no copy in the output): their publishes delete older
    versions like any other, so a gpt2-xl chain stays within keep_dataset_versions, and the session itself waits for
    its version and publishes again where that never landed."""
    lk = local_kaggle
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(10)})
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(20)})
    lk.app.inject("lost_publish", dataset=CKPT, count=1)  # the session's first publish answers "Ok", lands nothing
    out, _ = probe(lk, tmp_path, """
        import time
        from shared.kaggle.proof import dataset_version, verify_publish
        from shared.kaggle.publish import publish_checkpoint
        from scripts.chain.checkpoint_room import publish_verify_s
        ctx.state.data["checkpoint_versions"] = [1, 2]
        out["working"] = (session_publishes(ctx, 2, 1800)[0], publish_verify_s(ctx.cfg.train.config))
        ctx.cfg = ctx.cfg.with_train(checkpoint_dir="{temp}/checkpoints", keep_checkpoints=1)
        out["temp"] = (session_publishes(ctx, 2, 1800)[0], publish_verify_s(ctx.cfg.train.config))
        ckpt = ctx.workdir / "temp" / "step_000030"
        ckpt.mkdir(parents=True)
        (ckpt / "checkpoint.json").write_text(json.dumps({"format": 1, "step": 30, "files": {}}))
        before = dataset_version(client.api, CKPT)[0]
        publish_checkpoint(client.api, ckpt, CKPT, ctx.workdir, delete_old_versions=True)
        lines = []
        out["verify"] = verify_publish(client.api, CKPT, before, 2.0, log=lines.append,
                                       republish=lambda: publish_checkpoint(client.api, ckpt, CKPT, ctx.workdir),
                                       sleep=lambda s: time.sleep(0.1))
        out["lines"] = lines
        out["head"] = dataset_head(ctx, CKPT)
    """)
    assert out["working"] == [True, 0.0] and out["temp"] == [True, 600.0]
    assert out["lines"] == [f"warning: the publish to {CKPT} did not land (no version after 2 appeared); publishing "
                            "the checkpoint again"]
    assert out["verify"] == {"verified_version": 3, "republished": True}
    assert out["head"] == [3, 30] and live_numbers(lk, CKPT) == [1, 2, 3]  # the lost delete deleted nothing


@pytest.mark.slow
def test_the_hellaswag_file_becomes_a_dataset_the_train_kernel_reads(local_kaggle, tmp_path):
    out, log = probe(local_kaggle, tmp_path, """
        from scripts.chain.hellaswag import ensure_hellaswag_dataset
        ref = ensure_hellaswag_dataset(ctx)
        ctx.state.data["hellaswag_dataset"] = ref
        out["again"] = ensure_hellaswag_dataset(ctx)  # exists: not uploaded twice
        out["ref"] = ref
        folder = chain.train.build("push-1", 0)
        meta = json.loads((folder / "kernel-metadata.json").read_text())
        out["sources"] = meta["dataset_sources"]
        code = (folder / (meta["code_file"])).read_text()
        out["setting"] = '"hellaswag_file": "{input:' + ref + '}/hellaswag_val.jsonl"' in code
    """, hellaswag="demo")
    ref = "alice/unit-run-hellaswag"
    assert out == {"again": ref, "ref": ref, "sources": [CKPT, CKPT + "-b", "alice/tokens", ref],
                   "setting": True}
    assert live_numbers(local_kaggle, ref) == [1] and f"uploaded HellaSwag (demo) as {ref}" in log
    from shared.train.hellaswag import read_jsonl

    files = list((local_kaggle.root / "datasets").rglob("hellaswag_val.jsonl"))
    assert files and len(read_jsonl(files[0])) == 200  # the demo set, in HellaSwag's own format


def test_the_eval_kernel_expects_the_version_the_last_session_left(local_kaggle, tmp_path):
    out, _ = probe(local_kaggle, tmp_path, """
        ctx.state.data["train_sessions"] = [{"n": 1, "step_after": 20, "ckpt_version_after": 3}]
        folder = chain.eval.build("push-eval")
        code = next(p for p in folder.iterdir() if p.suffix == ".py").read_text()
        out["expects"] = '"expect_step": 20' in code and '"expect_version": 3' in code
    """)
    assert out == {"expects": True}


PART_OUTPUT = """
import json
from pathlib import Path
Path("manifest.json").write_text(json.dumps({manifest!r}))
"""


@pytest.mark.slow
def test_a_tokenize_part_cut_short_by_its_sessions_deadline_is_told_with_its_shortfall(local_kaggle, tmp_path):
    # Part 0 ended at its session's deadline (shared/tokenize/part.py writes stop_reason "session_deadline"),
    # part 1 at its token count: the chain says how many tokens the run lacks, once, for part 0 only.
    lk = local_kaggle
    from shared.tokenize.manifest import MANIFEST_FORMAT

    parts = {0: {"format": MANIFEST_FORMAT, "complete": True, "stop_reason": "session_deadline", "num_tokens": 61_000,
                 "tokens_per_part": 100_000},
             1: {"format": MANIFEST_FORMAT, "complete": True, "stop_reason": "tokens_per_part", "num_tokens": 100_000,
                 "tokens_per_part": 100_000}}
    for part, manifest in parts.items():
        ref = f"alice/unit-run-tokens-part-{part}"
        lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / f"part-{part}", ref,
                                                          PART_OUTPUT.format(manifest=manifest))))
        assert lk.wait(ref) == ("COMPLETE", None)
    out, log = probe(lk, tmp_path, """
        chain.tokenize.run()
        out["short"] = chain.state.data.get("tokenize_short")
        out["done"] = chain.state.data.get("tokenize")
    """, token_datasets=[], tokenize={"parts": 2})
    assert out == {"short": {"0": 39_000}, "done": {"0": "COMPLETE", "1": "COMPLETE"}}
    assert ("notice: tokenize part 0 reached its session's deadline with 61,000 of its 100,000 tokens: part 1 "
            "continues the stream from there; the run holds 39,000 tokens fewer than planned (training starts a new "
            "epoch over the parts where it runs out)") in log
    assert log.count("reached its session's deadline") == 1


@pytest.mark.slow
def test_a_session_killed_after_its_midway_publish_resumes_the_chain_from_that_checkpoint(local_kaggle, tmp_path):
    # Killed before its end (a kill discards the output: no publish record), the session had published a checkpoint
    # midway (shared/kaggle/publish.py MidwayPublish): the chain takes that version and step, and counts it live.
    lk = local_kaggle
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(10)})
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "k", "alice/unit-run-train",
                                                      "raise SystemExit('killed at the limit')")))
    assert lk.wait("alice/unit-run-train")[0] == "ERROR"
    add_version(lk, tmp_path, CKPT, {"checkpoint.json": manifest(25)})  # its midway publish
    out, _ = probe(lk, tmp_path, """
        ctx.state.data["checkpoint_versions"] = [1]
        sess = {"n": 1, "key": "train-1", "version": 1, "ckpt_version": 1, "step_before": 10, "delete_old": False}
        version, step, info = chain.train.after_session("alice/unit-run-train", sess, CKPT)
        out["after"] = [version, step, info["ckpt_version_after"]]
        out["live"] = ctx.state.data["checkpoint_versions"]
    """)
    assert out == {"after": [2, 25, 2], "live": [1, 2]}


def test_a_session_that_made_two_versions_has_both_counted_live_unless_it_deleted_the_older(local_kaggle, tmp_path):
    # Its midway publish (version 2) and its final one (3): both count against keep_dataset_versions.
    out, _ = probe(local_kaggle, tmp_path, """
        ctx.state.data["checkpoint_versions"] = [1]
        note_version(ctx, 3, False)
        out["kept"] = list(ctx.state.data["checkpoint_versions"])
        note_version(ctx, 5, True)
        out["deleted"] = list(ctx.state.data["checkpoint_versions"])
        out["delete_next"] = session_publishes(ctx, 5, 1800)[0]
        note_version(ctx, 6, False)
        out["after"] = list(ctx.state.data["checkpoint_versions"])
    """, keep_dataset_versions=2)
    assert out == {"kept": [1, 2, 3], "deleted": [5], "delete_next": False, "after": [5, 6]}
