"""Which credential a session publishes with: its own notebook token where Kaggle lets it write, else the attached
API token or key, proven in the bootstrap before any training by a real, harmless write (the checkpoint dataset's
metadata written back as it is); with none, one line and exit 2 where the checkpoints would be lost. Each case runs
a real session of the local Kaggle, which gives every session a notebook token as Kaggle does (KAGGLE_API_V1_TOKEN)
and can be told that such tokens may not write datasets."""

import json
import os
import threading

import pytest
from kaggle_fixtures import KEY, USER, save_without_running, wait_for, write_dataset, write_kernel

from shared.kaggle.credential import ATTACHED_KEY, NOTEBOOK_TOKEN, TokenFacts
from shared.kaggle.publish import MANIFEST as MANIFEST_NAME

REF, DATASET = f"{USER}/cred-train", f"{USER}/cred-checkpoints"
# How the bootstrap names the notebook's token that publishes, with what Kaggle says of it (by default here).
TOKEN_TERMS = TokenFacts(True, "resources.admin:*", 0).terms()
WITH_TOKEN = f"publishing to {DATASET} with {NOTEBOOK_TOKEN} ({TOKEN_TERMS})"

# A train kernel's bootstrap and publish, around a checkpoint made by hand instead of by training.
SESSION = f"""
import json, os, pathlib, sys, time
from shared.errors import run_cli
from shared.kaggle.bootstrap import resolve_build
from shared.kaggle.publish import MANIFEST, after_training

BUILD = {{"kernel": "train", "accelerator": "",
         "settings": {{"out_dir": "{{working}}/train", "checkpoint_dir": "{{temp}}/checkpoints"}},
         "checkpoint_dataset": {{"dataset": "{DATASET}", "publish": True, "expect_step": 0}}}}

def main():
    built = resolve_build(BUILD)
    print("bootstrap done", flush=True)
    gate = os.environ.get("CRED_TEST_GATE")  # the test's: wait for it before publishing
    while gate and not os.path.exists(gate):
        time.sleep(0.05)
    ckpt = pathlib.Path(built.settings["checkpoint_dir"]) / "step_000040"
    ckpt.mkdir(parents=True)
    (ckpt / MANIFEST).write_text(json.dumps({{"step": 40, "files": {{}}}}))
    (ckpt / "model.safetensors").write_bytes(b"weights-at-step-40")

    class Result:
        step, checkpoint, start_step = 40, ckpt, 0

    record = after_training(Result(), built.publish)
    print("RECORD " + json.dumps(record, default=str), flush=True)

run_cli(main)
"""


def run_session(lk, tmp_path, secrets: bool | dict, between=None, session: str = SESSION
                ) -> tuple[str, list[str], dict | None, list[int]]:
    """Push the session (with `secrets` attached first: True, the key; a dict, those) and wait, calling `between()`
    after its bootstrap, before its publish; -> (status, its log lines, its publish record, the checkpoint dataset's
    version numbers)."""
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", DATASET, {"README.md": "no checkpoint"})))
    folder = write_kernel(tmp_path / "k", REF, session, enable_internet=True)
    if secrets:
        save_without_running(lk, folder)
        attached = secrets if isinstance(secrets, dict) else {"KAGGLE_USERNAME": USER, "KAGGLE_KEY": KEY}
        for name, value in attached.items():
            lk.app.attach_secret(REF, name, value)
    if between is not None:
        gate = tmp_path / "gate"
        threading.Thread(target=lambda: (wait_for(lambda: _logged(lk, "bootstrap done"), 60), between(),
                                         gate.touch()), daemon=True).start()
    lk.cli("kernels", "push", "-p", str(folder))
    status, _ = lk.wait(REF, timeout=120)
    log = (_version_dir(lk) / "log.jsonl").read_text()
    text = "".join(json.loads(line)["data"] for line in log.splitlines()).splitlines()
    record = next((json.loads(x[len("RECORD "):]) for x in text if x.startswith("RECORD ")), None)
    with lk.app.store.lock:
        versions = [v["number"] for v in lk.app.state["datasets"][DATASET]["versions"]]
    shown = [KEY, *(secrets.values() if isinstance(secrets, dict) else [])]
    assert not any(value in log for value in shown if value != USER)  # no key or token is ever printed
    return status, text, record, versions


def test_a_session_with_no_secrets_publishes_with_its_own_notebook_token(local_kaggle, tmp_path):
    status, lines, record, versions = run_session(local_kaggle, tmp_path, secrets=False)
    assert status == "COMPLETE", lines
    assert WITH_TOKEN in lines
    assert record["published"] is True and record["action"] == "versioned" and record["step"] == 40
    assert versions == [1, 2]
    files = local_kaggle.root / "datasets" / USER / "cred-checkpoints" / "2"
    assert (files / "model.safetensors").read_bytes() == b"weights-at-step-40"


def test_a_token_that_may_not_write_and_no_secrets_stop_the_session_before_training_in_one_line(
        local_kaggle, tmp_path):
    local_kaggle.app.notebook_token_writes = False
    status, lines, record, versions = run_session(local_kaggle, tmp_path, secrets=False)
    assert status == "ERROR" and record is None and "bootstrap done" not in lines
    assert [x for x in lines if x.startswith("error:")] == [(
        f"error: this session cannot publish its checkpoints (no credential can publish to {DATASET} "
        f"({NOTEBOOK_TOKEN}: HTTP 403)), and they would live in /kaggle/temp, which is gone when the session ends; "
        "stopping before training").replace("/kaggle/temp", _temp_of(local_kaggle))]
    assert versions == [1]


def test_a_token_that_may_not_write_falls_back_to_the_attached_key_which_publishes(local_kaggle, tmp_path):
    local_kaggle.app.notebook_token_writes = False
    status, lines, record, versions = run_session(local_kaggle, tmp_path, secrets=True)
    assert status == "COMPLETE", lines
    assert f"notice: {NOTEBOOK_TOKEN} ({TOKEN_TERMS}) cannot publish to {DATASET} (HTTP 403)" in lines
    assert f"publishing to {DATASET} with {ATTACHED_KEY}" in lines
    assert record["published"] is True and versions == [1, 2]


def test_a_token_refused_at_the_publish_itself_publishes_again_with_the_attached_key(local_kaggle, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setenv("CRED_TEST_GATE", str(tmp_path / "gate"))
    status, lines, record, versions = run_session(
        local_kaggle, tmp_path, secrets=True, between=lambda: setattr(local_kaggle.app, "notebook_token_writes", False))
    assert status == "COMPLETE", lines
    assert WITH_TOKEN in lines
    assert any(x.startswith(f"notice: the publish to {DATASET} with the notebook's token failed (HTTP 403")
               and x.endswith("publishing with the attached key") for x in lines), lines
    assert record["published"] is True and versions == [1, 2]


@pytest.mark.slow
def test_a_chain_whose_session_cannot_publish_stops_after_that_session_in_one_line_naming_the_secrets(
        local_kaggle, tmp_path, demo_data, image_pythons):
    """The user went on without attaching the key, and the notebook's token may not write: the first train session
    stops in its first minute (its checkpoints would live in /kaggle/temp), and the chain stops after it, naming
    what to attach, instead of pushing sessions that would stop the same way."""
    from helpers import error_lines
    from test_chain import DEMO, NOTEBOOKS_STOP, run_chain, session_log, write_config
    from test_chain_datasets import upload_tokens

    lk = local_kaggle
    upload_tokens(lk, tmp_path, "alice/cred-tokens", demo_data)
    # Kept in /kaggle/temp, a checkpoint's publish includes the session's 600-s wait for its version.
    config = write_config(tmp_path / "cred.json", name="cred-run", tokenize={}, eval={"enabled": False},
                          token_datasets=["alice/cred-tokens"], session_limit_s=900, publish_margin_s=620,
                          train={**DEMO["train"], "checkpoint_dir": "{temp}/checkpoints"})
    work, ref, ckpt = tmp_path / "w", f"{USER}/cred-run-train", f"{USER}/cred-run-checkpoints"
    contact = run_chain(lk, config, work)
    assert contact.returncode == 2 and error_lines(contact.stderr) == [NOTEBOOKS_STOP]
    lk.app.notebook_token_writes = False
    proc = run_chain(lk, config, work, timeout=300)  # run again, nothing attached
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = error_lines(proc.stderr)
    with lk.app.store.lock:
        kernel = lk.app.kernels.get(ref)
        versions = [(v["status"], v["quick_save"]) for v in kernel["versions"]]
        temp = lk.app.store.kernel_dir(kernel, 2) / "kaggle" / "temp"
    assert versions == [("COMPLETE", True), ("ERROR", False)]  # one session pushed, none after it
    assert line == (
        "error: stopping: train session 1 stopped before training, as every later one would: this session cannot "
        f"publish its checkpoints (no credential can publish to {ckpt} ({NOTEBOOK_TOKEN}: HTTP 403)), and they "
        f"would live in {temp}, which is gone when the session ends; stopping before training. Attach the secrets "
        f"KAGGLE_USERNAME, KAGGLE_KEY to the train notebook: https://www.kaggle.com/code/{ref} (Add-ons > Secrets), "
        "then run the same command again (it goes on at step 0)")
    assert "  its last error line: error: this session cannot publish its checkpoints" in proc.stdout
    log = session_log(work / "sessions" / "train-01")
    assert not (work / "sessions" / "train-01" / "train" / "metrics.jsonl").exists()  # no step trained
    assert "resuming from" not in log and KEY not in log + proc.stdout + proc.stderr
    state = json.loads((work / "state.json").read_text())
    assert [(s["status"], s["step_after"], s["bound_to_repeat"]) for s in state["train_sessions"]] == [
        ("ERROR", 0, True)]


def test_a_session_stopped_for_want_of_a_credential_is_no_failure_in_a_row_once_the_key_is_attached():
    from scripts.chain.train_stage import _trailing_failures

    stopped = {"n": 1, "ended": 1.0, "status": "ERROR", "step_before": 0, "step_after": 0, "bound_to_repeat": True}
    assert list(_trailing_failures([stopped])) == []
    failed = {**stopped, "n": 2, "bound_to_repeat": False}
    assert [s["n"] for s in _trailing_failures([stopped, failed])] == [2]
    assert [s["n"] for s in _trailing_failures([{**stopped, "bound_to_repeat": False}, failed])] == [2, 1]


@pytest.mark.parametrize("writes", [True, False])
def test_the_local_kaggle_refuses_dataset_writes_with_a_notebook_token_only_when_told(local_kaggle, writes):
    from scripts.local_kaggle import ApiError

    accounts = local_kaggle.app.accounts
    local_kaggle.app.notebook_token_writes = writes
    token = accounts.issue_notebook_token(USER)
    header = f"Bearer {token}"
    assert accounts.authenticate(header) == USER
    accounts.authorize(header, "GetDatasetStatus")  # reads always
    accounts.authorize(f"Bearer {KEY}", "CreateDatasetVersion")  # a key always writes
    if writes:
        accounts.authorize(header, "CreateDatasetVersion")
    else:
        with pytest.raises(ApiError) as err:
            accounts.authorize(header, "CreateDatasetVersion")
        assert err.value.status == 403
    accounts.revoke_notebook_token(token)
    with pytest.raises(ApiError) as err:
        accounts.authenticate(header)
    assert err.value.status == 401


def _logged(lk, text: str) -> bool:
    try:
        return text in (_version_dir(lk) / "log.jsonl").read_text()
    except Exception:  # not pushed yet (the local Kaggle's 404), or no log yet
        return False


def _version_dir(lk):
    with lk.app.store.lock:
        kernel = lk.app.kernels.get(REF)
        return lk.app.store.kernel_dir(kernel, kernel["versions"][-1]["number"])


def _temp_of(lk) -> str:
    return str(_version_dir(lk) / "kaggle" / "temp")


def test_a_message_about_a_failed_call_never_shows_the_notebooks_token(tmp_path, monkeypatch):
    from shared.errors import describe_error
    from shared.kaggle.credential import notebook_token_present, secret_values, use_credential

    token = tmp_path / "token"
    token.write_text("nb-0123456789abcdef\n")
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Batch")
    monkeypatch.setenv("KAGGLE_DATA_PROXY_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("KAGGLE_API_V1_TOKEN", str(token))
    monkeypatch.setenv("KAGGLE_USERNAME", USER)
    monkeypatch.setenv("KAGGLE_KEY", KEY)
    assert notebook_token_present()
    line = describe_error(RuntimeError(f"401 for Bearer nb-0123456789abcdef (user {USER}, key {KEY})"),
                          secret_values())
    assert "nb-0123456789abcdef" not in line and KEY not in line and "401 for Bearer" in line
    use_credential(ATTACHED_KEY)  # the token hidden from the clients, still masked
    try:
        assert "KAGGLE_API_V1_TOKEN" not in os.environ and notebook_token_present()
        assert "nb-0123456789abcdef" in secret_values()
    finally:
        use_credential(NOTEBOOK_TOKEN)
    assert os.environ["KAGGLE_API_V1_TOKEN"] == str(token)


# A train session that publishes a checkpoint midway (PublishPlan.midway_s) while "training" goes on: the trainer's
# rotation deletes that checkpoint right after, and the session then ends with its final one.
MIDWAY_SESSION = f"""
import json, pathlib, shutil, time
from shared.errors import run_cli
from shared.kaggle.bootstrap import resolve_build
from shared.kaggle.env import kaggle_paths
from shared.kaggle.publish import MANIFEST, MidwayPublish, after_training

BUILD = {{"kernel": "train", "accelerator": "",
         "settings": {{"out_dir": "{{working}}/train", "checkpoint_dir": "{{temp}}/checkpoints"}},
         "checkpoint_dataset": {{"dataset": "{DATASET}", "publish": True, "expect_step": 0, "midway_s": 1800}}}}

def checkpoint(step):
    ckpt = pathlib.Path(built.settings["checkpoint_dir"]) / f"step_{{step:06d}}"
    ckpt.mkdir(parents=True)
    (ckpt / MANIFEST).write_text(json.dumps({{"step": step, "files": {{}}}}))
    (ckpt / "model.safetensors").write_bytes(f"weights-at-step-{{step}}".encode())
    (ckpt / "xla_cache").mkdir()  # a subfolder, as the compile cache is
    (ckpt / "xla_cache" / "graph").write_bytes(f"graph-at-step-{{step}}".encode())
    return ckpt

def main():
    global built
    built = resolve_build(BUILD)
    midway = MidwayPublish(built.publish, time.monotonic(), kaggle_paths().temp / "gpt2k-midway")
    midway(10, checkpoint(10))  # before midway_s: not published
    midway.started -= 3600  # an hour later
    midway(20, checkpoint(20))  # the first one past it: published, while "training" goes on
    shutil.rmtree(pathlib.Path(built.settings["checkpoint_dir"]) / "step_000010")
    shutil.rmtree(pathlib.Path(built.settings["checkpoint_dir"]) / "step_000020")  # the rotation
    midway(30, checkpoint(30))  # one midway publish a session

    class Result:
        step, checkpoint, start_step = 40, checkpoint(40), 0

    record = after_training(Result(), built.publish, midway=midway)
    print("RECORD " + json.dumps(record, default=str), flush=True)

run_cli(main)
"""


@pytest.mark.slow
def test_a_long_session_publishes_a_checkpoint_midway_that_survives_the_rotation_then_its_final_one(local_kaggle,
                                                                                                      tmp_path):
    lk = local_kaggle
    lk.cli("datasets", "create", "-p", str(write_dataset(tmp_path / "ds", DATASET, {"README.md": "no checkpoint"})))
    lk.cli("kernels", "push", "-p", str(write_kernel(tmp_path / "k", REF, MIDWAY_SESSION, enable_internet=True)))
    status, _ = lk.wait(REF, timeout=120)
    log = (_version_dir(lk) / "log.jsonl").read_text()
    lines = "".join(json.loads(line)["data"] for line in log.splitlines()).splitlines()
    assert status == "COMPLETE", lines
    record = next(json.loads(x[len("RECORD "):]) for x in lines if x.startswith("RECORD "))
    assert record["published"] is True and record["step"] == 40
    assert record["midway"]["step"] == 20 and record["midway"]["published"] is True
    assert sum("midway through the session" in line for line in lines) == 1
    with lk.app.store.lock:
        versions = [(v["number"], v["notes"], bool(v.get("deleted")))
                    for v in lk.app.state["datasets"][DATASET]["versions"]]
    # The midway version deletes nothing and stays (the final one here keeps older versions, as built).
    assert versions == [(1, "Initial release", False), (2, "checkpoint at step 20", False),
                        (3, "checkpoint at step 40", False)]
    folder = lk.root / "datasets" / USER / "cred-checkpoints"
    assert (folder / "2" / "model.safetensors").read_bytes() == b"weights-at-step-20"  # though rotated away
    assert (folder / "2" / "xla_cache__graph").read_bytes() == b"graph-at-step-20"
    assert json.loads((folder / "2" / "checkpoint.json").read_text())["step"] == 20
    assert (folder / "3" / "model.safetensors").read_bytes() == b"weights-at-step-40"


def test_the_midway_publish_never_copies_the_stable_checkpoint_it_carries_from_a_read_only_mount(tmp_path,
                                                                                                 monkeypatch):
    """A session resumed from the dataset carries its stable phase's checkpoint on, staged as symlinks into
    /kaggle/input (read-only, another file system: no hard link can be made there). The midway publish links the
    checkpoint it publishes (the rotation may delete it) and symlinks the stable one: no byte of it is copied,
    neither on the training thread nor for the upload (gpt2-xl's is 18.7 GB)."""
    import shutil
    import time

    from shared.kaggle import bootstrap, publish

    mount = tmp_path / "input" / "run-checkpoints"  # the dataset as Kaggle mounts it: flat names
    mount.mkdir(parents=True)
    for name, text in {MANIFEST_NAME: json.dumps({"step": 60, "files": {}}), "model.safetensors": "weights 60",
                       f"stable__{MANIFEST_NAME}": json.dumps({"step": 30, "files": {}}),
                       "stable__model.safetensors": "weights 30", "stable__xla_cache__graph": "graph 30"}.items():
        (mount / name).write_text(text)
    resume_root = bootstrap.stage_checkpoint(mount, tmp_path / "temp" / "gpt2k-resume")
    ckpt = tmp_path / "temp" / "checkpoints" / "step_000080"  # the session's own, trained on from step 60
    ckpt.mkdir(parents=True)
    (ckpt / MANIFEST_NAME).write_text(json.dumps({"step": 80, "files": {}}))
    (ckpt / "model.safetensors").write_text("weights 80")

    real_link, copied = os.link, []

    def link(src, dst, **kw):
        if str(src).startswith(str(mount)):
            raise OSError(18, "Invalid cross-device link")  # EXDEV, as from /kaggle/input
        real_link(src, dst, **kw)

    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(shutil, "copy2", lambda src, dst, **kw: copied.append(str(src)))
    uploaded = {}

    staged_seen = threading.Event()  # the upload waits until the staging is read (its links would add to it)

    def fake_publish(plan, snapshot, step, record, log, work_dir=None, stable=None):
        staged_seen.wait(30)
        folder = publish.write_dataset_folder(work_dir, plan.dataset, "", publish.checkpoint_files(snapshot) + [
            (f, "stable__" + n) for f, n in publish.checkpoint_files(stable)])
        uploaded.update({f.name: (f.is_symlink(), f.read_text()) for f in folder.iterdir()
                         if f.name != publish.DATASET_METADATA})
        record["published"] = True

    monkeypatch.setattr(publish, "_publish", fake_publish)
    plan = publish.PublishPlan(dataset="alice/run-checkpoints", midway_s=1.0, resume_root=str(resume_root))
    midway = publish.MidwayPublish(plan, time.monotonic() - 10, tmp_path / "temp" / "gpt2k-midway", log=lambda m: None)
    midway(80, ckpt)
    staged = tmp_path / "temp" / "gpt2k-midway"
    assert (staged / "stable" / "model.safetensors").resolve() == mount / "stable__model.safetensors"
    assert (staged / "stable" / "xla_cache" / "graph").is_symlink()
    assert os.stat(staged / "checkpoint" / "model.safetensors").st_nlink == 2  # a hard link: rotation-proof
    staged_seen.set()
    midway.wait()
    # (only the stable's files count: a thread an earlier test left running may copy its own)
    assert [c for c in copied if c.startswith(str(tmp_path))] == [] and midway.record == {"published": True}
    assert uploaded == {MANIFEST_NAME: (False, json.dumps({"step": 80, "files": {}})),
                        "model.safetensors": (False, "weights 80"),
                        f"stable__{MANIFEST_NAME}": (True, json.dumps({"step": 30, "files": {}})),
                        "stable__model.safetensors": (True, "weights 30"),
                        "stable__xla_cache__graph": (True, "graph 30")}
    assert not staged.exists()  # its links go with the publish


def test_only_sessions_of_an_hour_or_more_publish_midway_at_half_their_deadline():
    from scripts.chain.config import config_from_dict

    cfg = config_from_dict({"token_datasets": ["a/b"], "publish_margin_s": 1200})
    assert cfg.midway_publish_s(32400) == (32400 - 1200) / 2
    assert cfg.midway_publish_s(3600) == 1200.0 and cfg.midway_publish_s(3599) == 0.0


# Signs in with the key and runs the proof's write on the dataset named; prints what it returned.
PROVE = ("from shared.kaggle.credential import kaggle_api, prove_dataset_write; "
         "print(repr(prove_dataset_write(kaggle_api(from_secrets=False), {ds!r})))")


def _prove(lk, dataset: str) -> str:
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", PROVE.format(ds=dataset)], env={**lk.env, "PYTHONPATH": str(repo)},
                          capture_output=True, text=True, timeout=120, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_proofs_write_puts_the_metadata_back_as_it_was_and_makes_no_version(local_kaggle, tmp_path):
    lk = local_kaggle
    folder = write_dataset(tmp_path / "ds", DATASET, {"README.md": "no checkpoint"}, title="Run checkpoints")
    lk.cli("datasets", "create", "-p", str(folder))
    with lk.app.store.lock:
        before = json.loads(json.dumps(lk.app.state["datasets"][DATASET]))
    assert _prove(lk, DATASET) == "None"  # written
    with lk.app.store.lock:
        after = lk.app.state["datasets"][DATASET]
        assert after == before and after["is_private"] is True and len(after["versions"]) == 1


def test_the_proof_writes_nothing_where_kaggle_does_not_say_the_dataset_is_private(local_kaggle, tmp_path):
    lk = local_kaggle
    folder = write_dataset(tmp_path / "ds", f"{USER}/open-data", {"README.md": "public"}, title="Open data set")
    lk.cli("datasets", "create", "-p", str(folder), "--public")
    assert "does not say it is private" in _prove(lk, f"{USER}/open-data")
    with lk.app.store.lock:
        assert lk.app.state["datasets"][f"{USER}/open-data"]["is_private"] is False
