"""A Kaggle session as it really is: packages its image lacks are installed at start (or the kernel stops in one
line), and a kernel that cannot publish its checkpoints says so before training."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import REPO, error_lines, importable_in
from kaggle_fixtures import write_kernel
from test_session_faults import Reply

from shared.errors import UserError, run_cli
from shared.kaggle import packages
from shared.kaggle.bootstrap import resolve_build
from shared.kaggle.publish import MANIFEST, after_training


def fake_installer(module: str):
    """An installer that puts an importable `module` into the target folder, recording what it was asked."""
    calls = []

    def install(requirements, target: Path):
        calls.append((requirements, target))
        (target / f"{module}.py").write_text("VALUE = 42\n")
        return None

    return install, calls


def test_a_missing_package_is_installed_pinned_into_the_session_temp_and_imports_after_the_image(session,
                                                                                              monkeypatch):
    monkeypatch.setitem(packages.PACKAGES, "wandb",
                        packages.Package("gpt2k_fake_wandb", ("gpt2k-fake-wandb==1.0",), "W&B logging"))
    install, calls = fake_installer("gpt2k_fake_wandb")
    lines = []
    assert packages.provide("wandb", log=lines.append, installer=install) is None
    target = session / "temp" / packages.TARGET_DIR
    assert calls == [(("gpt2k-fake-wandb==1.0",), target)]
    assert sys.path[-1] == str(target)  # last: the image's own packages win
    import gpt2k_fake_wandb

    assert gpt2k_fake_wandb.VALUE == 42
    assert len(lines) == 1 and lines[0].startswith("installed gpt2k-fake-wandb==1.0 for W&B logging in ")
    assert lines[0].endswith(f"(not in this image; into {target}, after the image's packages, gone with the session)")
    sys.modules.pop("gpt2k_fake_wandb")


def test_a_package_an_older_copy_in_the_image_breaks_goes_before_the_image_and_a_broken_one_is_refused(
        session, tmp_path, monkeypatch):
    image = tmp_path / "image"  # the image's own, too old, copy of a dependency
    image.mkdir()
    (image / "gpt2k_dep.py").write_text("VERSION = 1\n")
    sys.path.append(str(image))
    monkeypatch.setitem(packages.PACKAGES, "kaggle",
                        packages.Package("gpt2k_pub", ("gpt2k-pub==1.0",), "publishing checkpoints"))

    def install(requirements, target: Path):
        (target / "gpt2k_dep.py").write_text("VERSION = 2\n")
        (target / "gpt2k_pub.py").write_text("import gpt2k_dep\nassert gpt2k_dep.VERSION >= 2, 'gpt2k_dep too old'\n")

    lines = []
    assert packages.provide("kaggle", log=lines.append, installer=install) is None
    target = session / "temp" / packages.TARGET_DIR
    assert sys.path[0] == str(target) and sys.path.count(str(target)) == 1
    assert lines[0].endswith(f"into {target}, before the image's packages, which break it after them "
                             "(AssertionError: gpt2k_dep too old), gone with the session)")
    import gpt2k_pub  # noqa: F401  (imports here too now)

    sys.modules.pop("gpt2k_pub"), sys.modules.pop("gpt2k_dep")
    monkeypatch.setitem(packages.PACKAGES, "wandb",
                        packages.Package("gpt2k_broken", ("gpt2k-broken==1.0",), "W&B logging"))

    def install_broken(requirements, target: Path):
        (target / "gpt2k_broken.py").write_text("raise ImportError('libfoo.so: cannot open shared object file')\n")

    assert packages.provide("wandb", installer=install_broken) == (
        f"the gpt2k_broken package is not in this Kaggle image, and the copy pip installed into {target} does not "
        "import (ImportError: libfoo.so: cannot open shared object file); it is needed for W&B logging")


def test_a_package_with_a_fast_set_installs_it_alone_and_its_whole_closure_only_where_that_does_not_import(
        session, monkeypatch):
    monkeypatch.setitem(packages.PACKAGES, "kaggle", packages.Package(
        "gpt2k_fast_pub", ("gpt2k-fast-pub==1.0",), "publishing checkpoints", fast=("gpt2k-fast-pub==1.0", "dep==2")))
    calls = []

    def install(requirements, target: Path, no_deps: bool = False):
        calls.append((requirements, no_deps))
        # The fast set alone lacks a dependency the image does not have: only the whole closure brings it.
        (target / "gpt2k_fast_pub.py").write_text("import gpt2k_fast_dep\n")
        if not no_deps or image_has_dep:
            (target / "gpt2k_fast_dep.py").write_text("")

    image_has_dep = True
    lines = []
    assert packages.provide("kaggle", log=lines.append, installer=install) is None
    assert calls == [(("gpt2k-fast-pub==1.0", "dep==2"), True)]  # the fast set, without resolving: nothing more
    assert lines[0].startswith("installed gpt2k-fast-pub==1.0 for publishing checkpoints in ")
    sys.modules.pop("gpt2k_fast_pub", None), sys.modules.pop("gpt2k_fast_dep", None)
    for name in ("gpt2k_fast_pub.py", "gpt2k_fast_dep.py"):
        (session / "temp" / packages.TARGET_DIR / name).unlink()
    calls.clear()
    image_has_dep = False
    assert packages.provide("kaggle", log=lines.append, installer=install) is None
    assert calls == [(("gpt2k-fast-pub==1.0", "dep==2"), True), (("gpt2k-fast-pub==1.0",), False)]
    sys.modules.pop("gpt2k_fast_pub", None), sys.modules.pop("gpt2k_fast_dep", None)


def test_without_internet_a_required_package_stops_the_kernel_in_one_line_with_exit_2(session, monkeypatch):
    monkeypatch.setitem(packages.PACKAGES, "tiktoken",
                        packages.Package("gpt2k_not_here", ("gpt2k-not-here==1.0",), "GPT-2's tokenizer"))

    def offline(requirements, target):
        return "ERROR: No matching distribution found for gpt2k-not-here==1.0"

    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: packages.require("tiktoken", "tokenizing the corpus", installer=offline))
    assert exit_info.value.code == 2
    # An optional package is a notice instead, and the kernel goes on.
    notices = []
    problem = packages.provide("tiktoken", "tokenizing the corpus", log=notices.append, installer=offline)
    assert problem == ("the gpt2k_not_here package is not in this Kaggle image and could not be installed (ERROR: No "
                       "matching distribution found for gpt2k-not-here==1.0); it is needed for tokenizing the corpus: "
                       "turn on the notebook's internet (Settings > Internet)")
    assert notices == [] and "\n" not in problem


def test_wandb_is_off_with_a_one_line_notice_when_the_image_lacks_it_and_it_cannot_be_installed(session, tmp_path,
                                                                                                monkeypatch):
    from shared.train.metrics import MetricsLogger, read_metrics

    monkeypatch.setitem(packages.PACKAGES, "wandb",
                        packages.Package("gpt2k_no_wandb", ("gpt2k-no-wandb==1.0",), "W&B logging"))
    monkeypatch.setattr(packages, "pip_install", lambda requirements, target: "ERROR: no route to the index")
    lines = []
    logger = MetricsLogger(tmp_path / "run", 10, 0, {}, wandb_project="proj", progress=False, log=lines.append,
                           wandb_key="k" * 40)
    logger.write({"step": 1, "loss": 3.0})
    logger.close()
    assert lines == ["notice: W&B off: the gpt2k_no_wandb package is not in this Kaggle image and could not be "
                     "installed (ERROR: no route to the index); it is needed for W&B logging: turn on the notebook's "
                     "internet (Settings > Internet); logging to metrics.jsonl only"]
    assert [r["loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [3.0]


def test_the_wandb_key_is_the_environment_s_else_the_notebook_s_secret_else_none(session, tmp_path, monkeypatch):
    from shared.kaggle.secrets import wandb_key

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert wandb_key() is None  # not attached: W&B off, with the logger's notice
    (tmp_path / "secrets.json").write_text(json.dumps({"WANDB_API_KEY": "s" * 40}))
    assert wandb_key() == "s" * 40
    monkeypatch.setenv("WANDB_API_KEY", "e" * 40)
    assert wandb_key() == "e" * 40


def test_pip_with_no_way_to_the_index_fails_within_seconds_and_installs_nothing(tmp_path):
    """The real installer, as a session with internet off runs it: every request goes to a closed port."""
    env = {**os.environ, "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
           "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1"}
    env = {k: v for k, v in env.items() if not (k.startswith("PIP_") and k not in ("PIP_CONFIG_FILE",
                                                                                    "PIP_NO_CACHE_DIR"))}
    code = ("import sys; from pathlib import Path; from shared.kaggle.packages import pip_install; "
            "print(pip_install(('tiktoken==0.14.0',), Path(sys.argv[1])))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t")], env=env, capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().startswith("ERROR"), proc.stdout
    assert not list((tmp_path / "t").glob("tiktoken*"))



def test_pip_whose_index_never_answers_is_stopped_at_its_limit_and_installs_nothing(tmp_path):
    """A proxy that accepts connections and never answers (pip's own --timeout 15 s is per read, and retried): the
    install stops at PIP_TIMEOUT_S (3 s here), before pip's own timeout would, with one ERROR line."""
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)  # connections complete in the kernel's backlog; nothing is ever read or written
    port = server.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update({"HTTPS_PROXY": f"http://127.0.0.1:{port}", "HTTP_PROXY": f"http://127.0.0.1:{port}",
                "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1"})
    code = ("import sys, time; from pathlib import Path; from shared.kaggle import packages; "
            "packages.PIP_TIMEOUT_S = 3.0; began = time.monotonic(); "
            "print(packages.pip_install(('tiktoken==0.14.0',), Path(sys.argv[1]))); print(time.monotonic() - began)")
    try:
        proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "t")], env=env, capture_output=True,
                              text=True, timeout=120, cwd=REPO)
    finally:
        server.close()
    assert proc.returncode == 0, proc.stderr
    message, seconds = proc.stdout.strip().splitlines()
    assert message == "ERROR: pip install ran past 3 s and was stopped"
    assert 3.0 <= float(seconds) < 14.0  # stopped at the limit, not by pip's own 15-s read timeout
    assert not list((tmp_path / "t").glob("tiktoken*"))

def test_the_pins_are_the_versions_the_project_is_set_up_with():
    """The session installs exactly what the laptop's setup tests with (pyproject.toml pulls these)."""
    from importlib.metadata import version

    for pkg in packages.PACKAGES.values():
        for requirement in pkg.requirements + pkg.fast:
            name, pinned = requirement.split("==")
            assert version(name) == pinned, requirement


def train_build(checkpoint_dir: str) -> dict:
    return {"kernel": "train", "accelerator": "",
            "settings": {"out_dir": "{working}/train", "checkpoint_dir": checkpoint_dir},
            "checkpoint_dataset": {"dataset": "alice/run-checkpoints", "resume_setting": "resume_from",
                                   "publish": True, "expect_step": 0}}


def mount_checkpoint(session: Path, step: int) -> None:
    folder = session / "input" / "run-checkpoints"
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_text(json.dumps({"step": step, "files": {}}))


def test_a_kernel_that_cannot_publish_checkpoints_kept_in_temp_stops_before_training_with_nothing_staged(session):
    mount_checkpoint(session, 30)
    with pytest.raises(UserError) as err:
        resolve_build(train_build("{temp}/checkpoints"), log=lambda _: None)
    assert str(err.value) == (
        "this session cannot publish its checkpoints (no Kaggle credential is attached to this notebook: attach the "
        "secret KAGGLE_API_TOKEN (an API token), or KAGGLE_USERNAME and KAGGLE_KEY (a legacy key), on the notebook's "
        "page (Add-ons > Secrets)), and they would live in "
        f"{session / 'temp'}, which is gone when the session ends; stopping before training")
    assert sorted(p.name for p in (session / "temp").iterdir()) == []  # nothing staged, nothing installed


def test_a_kernel_that_cannot_publish_checkpoints_kept_in_working_leaves_them_to_the_chain(session):
    mount_checkpoint(session, 30)
    lines = []
    build = train_build("{working}/train/checkpoints")
    build["checkpoint_dataset"]["verify_s"] = 600.0  # what the chain bakes in for checkpoints kept in /kaggle/temp
    built = resolve_build(build, log=lines.append)
    assert built.publish.verify_s == 600.0 and resolve_build(train_build("x"), log=print).publish.verify_s == 0
    assert built.settings["resume_from"] == str(session / "temp" / "gpt2k-resume")
    assert (built.publish.dataset, built.publish.input_step) == ("alice/run-checkpoints", 30)
    assert built.publish.problem.startswith("no Kaggle credential is attached to this notebook")
    assert lines[0] == ("notice: this session cannot publish its checkpoint (no Kaggle credential is attached to this "
                        "notebook: attach the secret KAGGLE_API_TOKEN (an API token), or KAGGLE_USERNAME and "
                        "KAGGLE_KEY (a legacy key), on the notebook's page (Add-ons > Secrets)); the chain publishes "
                        "it from the session's output")

    class Result:
        step, checkpoint = 40, session / "working" / "train" / "checkpoints" / "step_000040"

    (session / "working").mkdir(exist_ok=True)
    record = after_training(Result(), built.publish, log=lines.append)
    assert record["published"] is False and record["step"] == 40
    assert record["reason"].startswith("no Kaggle credential is attached to this notebook")
    assert json.loads((session / "working" / "publish.json").read_text())["reason"] == record["reason"]


def test_an_eval_kernel_that_cannot_upload_its_kaggle_model_stops_before_any_work(session):
    build = {"kernel": "eval", "accelerator": "", "settings": {"kaggle_model": "alice/gpt2/pyTorch/base",
                                                              "hellaswag": "off", "prompts": ""}}
    with pytest.raises(UserError) as err:
        resolve_build(build, log=lambda _: None)
    assert str(err.value) == (
        "this session cannot upload the Kaggle Model alice/gpt2/pyTorch/base (no Kaggle credential is attached to "
        "this notebook: attach the secret KAGGLE_API_TOKEN (an API token), or KAGGLE_USERNAME and KAGGLE_KEY (a "
        "legacy key), on the notebook's page (Add-ons > Secrets)); stopping before any work")
    del build["settings"]["kaggle_model"]  # no upload asked for: nothing to check
    built = resolve_build(build, log=lambda _: None)
    assert (built.settings, built.publish) == ({"hellaswag": "off", "prompts": ""}, None)


def test_a_notebook_with_one_secret_attached_names_the_other(session, tmp_path):
    (tmp_path / "secrets.json").write_text(json.dumps({"KAGGLE_USERNAME": "alice"}))
    from shared.kaggle.publish import publish_problem

    assert publish_problem() == ("the secret KAGGLE_KEY is not attached to this notebook: attach it on the "
                                 "notebook's page (Add-ons > Secrets), or an API token as the secret KAGGLE_API_TOKEN")


INSTALLS_TIKTOKEN = textwrap.dedent("""
    from shared.errors import run_cli
    from shared.kaggle.packages import require
    run_cli(lambda: require("tiktoken", "tokenizing the corpus"))
    import tiktoken
    print("tiktoken", tiktoken.__version__)
    """)


@pytest.mark.slow
def test_a_session_in_the_cpu_image_installs_tiktoken_with_internet_and_stops_without(
        local_kaggle, tmp_path, image_pythons):
    lk = local_kaggle
    kdir = write_kernel(tmp_path / "k", "alice/needs-tiktoken", INSTALLS_TIKTOKEN, enable_internet=True)
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/needs-tiktoken", timeout=180) == ("COMPLETE", None)
    log = lk.cli("kernels", "logs", "alice/needs-tiktoken").stdout
    assert "installed tiktoken==0.14.0 for tokenizing the corpus in " in log and "tiktoken 0.14.0" in log
    write_kernel(kdir, "alice/needs-tiktoken", INSTALLS_TIKTOKEN, enable_internet=False)
    lk.cli("kernels", "push", "-p", str(kdir))
    assert lk.wait("alice/needs-tiktoken", timeout=180) == ("ERROR", "Kernel process exited with code 2")
    events = json.loads(lk.cli("kernels", "logs", "alice/needs-tiktoken").stdout)
    (line,) = error_lines("".join(e["data"] for e in events))
    assert line.startswith("error: the tiktoken package is not in this Kaggle image and could not be installed (")
    assert line.endswith("turn on the notebook's internet (Settings > Internet); stopping before any work")
    assert importable_in(image_pythons["cpu"], ("tiktoken",)) == []  # nothing leaked into the image


# --- the stable-phase checkpoint in the checkpoint dataset (train.extend) -----------------------------------------

def fake_checkpoint(folder: Path, step: int, extra: dict[str, bytes] | None = None) -> Path:
    """A checkpoint folder whose manifest (sizes, sha256) matches its files, as shared.train.checkpoint writes."""
    import hashlib

    files = {"model.safetensors": b"m%d" % step, "optimizer.safetensors": b"o%d" % step,
             "state.json": json.dumps({"step": step}).encode(), **(extra or {})}
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    (folder / MANIFEST).write_text(json.dumps({"format": 1, "step": step, "files": {
        name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in files.items()}}))
    return folder


class UploadingApi:
    """The kaggle client's dataset calls, keeping each uploaded version's files (a new dataset on first use)."""

    def __init__(self):
        self.versions: list[dict[str, bytes]] = []

    def dataset_status(self, dataset):
        if not self.versions:
            raise type("NotFound", (Exception,), {"response": type("R", (), {"status_code": 404})})()

    def _upload(self, folder):
        files = [f for f in Path(folder).iterdir() if f.name != "dataset-metadata.json"]
        self.versions.append({f.name: f.read_bytes() for f in files})

    def dataset_create_new(self, folder, **_):
        self._upload(folder)

    def dataset_create_version(self, folder, notes, **_):
        self._upload(folder)


def test_the_stable_phase_checkpoint_travels_beside_the_newest_and_is_staged_where_extend_looks(tmp_path):
    from shared.kaggle.bootstrap import stage_checkpoint
    from shared.kaggle.checkpoint_files import stable_checkpoint
    from shared.kaggle.publish import publish_checkpoint
    from shared.train.checkpoint import list_checkpoints, verify_checkpoint

    root = tmp_path / "checkpoints"
    newest = fake_checkpoint(root / "step_000040", 40, {"xla_cache/graph-a": b"compiled"})
    fake_checkpoint(root / "stable" / "step_000010", 10)
    fake_checkpoint(root / "stable" / "step_000020", 20, {"xla_cache/graph-b": b"compiled too"})
    (root / "stable" / "step_000030").mkdir()  # no manifest: not a checkpoint
    stable = stable_checkpoint(root, None)
    assert stable == root / "stable" / "step_000020"
    api = UploadingApi()
    out = publish_checkpoint(api, newest, "alice/run-checkpoints", tmp_path / "work", stable=stable)
    assert (out["step"], out["stable_step"]) == (40, 20)
    assert sorted(api.versions[0]) == [
        "checkpoint.json", "model.safetensors", "optimizer.safetensors", "stable__checkpoint.json",
        "stable__model.safetensors", "stable__optimizer.safetensors", "stable__state.json",
        "stable__xla_cache__graph-b", "state.json", "xla_cache__graph-a"]

    mount = tmp_path / "mount"  # the dataset as a session sees it: flat files
    mount.mkdir()
    for name, data in api.versions[0].items():
        (mount / name).write_bytes(data)
    staged = stage_checkpoint(mount, tmp_path / "resume")
    assert sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()) == [
        "stable/step_000020/checkpoint.json", "stable/step_000020/model.safetensors",
        "stable/step_000020/optimizer.safetensors", "stable/step_000020/state.json",
        "stable/step_000020/xla_cache/graph-b", "step_000040/checkpoint.json", "step_000040/model.safetensors",
        "step_000040/optimizer.safetensors", "step_000040/state.json", "step_000040/xla_cache/graph-a"]
    assert verify_checkpoint(staged / "step_000040") is None
    assert verify_checkpoint(staged / "stable/step_000020") is None
    assert (staged / "stable/step_000020/model.safetensors").read_bytes() == b"m20"
    # Resuming without --extend sees only the newest; --extend's roots (shared/train/trainer.py) add stable/.
    assert [p.name for p in list_checkpoints(staged)] == ["step_000040"]
    assert [p.name for p in list_checkpoints(staged / "stable")] == ["step_000020"]

    # The next session carries the staged one on, until it writes a newer one of its own.
    own = tmp_path / "next"
    fake_checkpoint(own / "step_000050", 50)
    assert stable_checkpoint(own, staged) == staged / "stable" / "step_000020"
    fake_checkpoint(own / "stable" / "step_000045", 45)
    assert stable_checkpoint(own, staged) == own / "stable" / "step_000045"
    assert stable_checkpoint(tmp_path / "nothing", None) is None


@pytest.mark.parametrize("extend, start, step, new", [
    (True, 20, 30, True),     # --extend: from the stable phase (20) below the dataset's 40, on to 30: publish
    (True, 20, 20, False),    # trained nothing
    (True, 0, 30, False),     # started over while the dataset holds 40: never published over it
    (False, 20, 30, False),   # not extending: 30 is older than the dataset's 40
    (False, 40, 50, True),    # the usual session
])
def test_a_session_publishes_what_it_trained_past_where_it_began_only_when_extending(session, extend, start, step,
                                                                                    new):
    from shared.kaggle.publish import PublishPlan

    class Result:
        checkpoint = session / "working" / "train" / "checkpoints" / f"step_{step:06d}"

    Result.step, Result.start_step = step, start
    (session / "working").mkdir(parents=True, exist_ok=True)
    plan = PublishPlan("alice/run-checkpoints", input_step=40, problem="no secrets here", extend=extend)
    record = after_training(Result(), plan, log=lambda _: None)
    assert record["start_step"] == start and record["published"] is False
    assert record["reason"] == ("no secrets here" if new else "nothing new: the dataset already holds step 40")


class ScriptedDatasetApi:
    """GetDatasetStatus, then GetDataset's current version, answering from a script of (version number, status)
    reads (the last repeats), recording each republish; GetDataset's versions name no status of their own, so that
    is what is read."""

    def __init__(self, reads):
        self.reads, self.republished, self.number = list(reads), 0, 0

    def build_kaggle_client(self):
        import contextlib
        from types import SimpleNamespace

        def get_dataset_status(request):
            self.number, status = self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]
            return SimpleNamespace(status=status)

        def get_dataset(request):
            return SimpleNamespace(current_version_number=self.number, versions=[])

        service = SimpleNamespace(get_dataset=get_dataset, get_dataset_status=get_dataset_status)
        return contextlib.nullcontext(SimpleNamespace(datasets=SimpleNamespace(dataset_api_client=service)))

    def republish(self):
        self.republished += 1


def test_a_new_version_counts_only_once_its_status_is_read_after_its_number():
    from shared.kaggle.proof import VersionSeen, wait_for_new_version

    def reads(script):
        answers = iter(script)
        return lambda: next(answers)

    # A stale "ready" of version 2, then version 3 processing, then ready: settled on the second read of 3.
    script = [(2, "ready"), (3, "ready"), (3, "pending"), (3, "ready"), (4, "ready")]
    seen = wait_for_new_version(reads(script), 2, 60, sleep=lambda s: None)
    assert seen == VersionSeen(3, "ready", True)  # (3, "ready") read first counted only as the number seen
    assert wait_for_new_version(reads([(3, "failed"), (3, "failed")]), 2, 60, sleep=lambda s: None) == VersionSeen(
        3, "failed", True)
    assert wait_for_new_version(reads([(2, "ready")]), 2, 0, sleep=lambda s: None) == VersionSeen(2, "ready", False)


@pytest.mark.parametrize("reads, republished, result, line", [
    ([(3, "ready")], 0, {"verified_version": 3, "republished": False}, None),
    ([(3, "failed"), (3, "failed"), (4, "ready")], 1, {"verified_version": 4, "republished": True},
     "warning: the publish to alice/ckpt did not land (version 3 is failed); publishing the checkpoint again"),
    ([(3, "pending")], 0, {"verified_version": None, "republished": False},
     "publish: version 3 of alice/ckpt is still pending after 0 s; the chain waits for it"),
    ([(2, "ready")], 1, {"verified_version": None, "republished": True},
     "warning: the publish to alice/ckpt did not land (no version after 2 appeared); publishing the checkpoint again"),
])
def test_a_publish_with_no_other_copy_is_published_again_only_where_its_version_failed_or_never_appeared(
        reads, republished, result, line):
    from shared.kaggle.proof import verify_publish

    api, lines = ScriptedDatasetApi(reads), []
    # A new version that never settles or never appears: give up at once (the wait runs on the wall clock, and
    # with no sleep it would spin for the whole timeout).
    timeout = 60 if any(number > 2 and status == "ready" for number, status in reads) else 0
    assert verify_publish(api, "alice/ckpt", 2, timeout, api.republish, log=lines.append,
                          sleep=lambda s: None) == result
    assert api.republished == republished
    assert lines[:1] == ([line] if line else [])


def test_a_publish_still_running_a_minute_before_the_kill_gives_up_so_the_output_is_kept(session, monkeypatch):
    import threading
    import time

    import shared.kaggle.publish as publish

    released = threading.Event()
    monkeypatch.setattr(publish, "_publish", lambda *args: released.wait(120))  # an upload that never ends
    (session / "working").mkdir(parents=True, exist_ok=True)
    ckpt = session / "temp" / "checkpoints" / "step_000040"

    class Result:
        step, checkpoint, start_step = 40, ckpt, 0

    lines = []
    began = time.monotonic()
    try:
        record = after_training(Result(), publish.PublishPlan(dataset="alice/run-checkpoints", publish_s=600),
                                log=lines.append, session_end=began + publish.PUBLISH_EXIT_S + 2)
    finally:
        released.set()
    assert time.monotonic() - began < 60  # given up about 2 s in, not at the kill
    assert record["published"] is False and record["reason"] == "no answer within 2 s"
    assert lines == ["warning: could not publish step 40 to alice/run-checkpoints: no answer within 2 s; "
                     "it stays in the kernel output"]
    assert json.loads((session / "working" / "publish.json").read_text())["reason"] == "no answer within 2 s"


def test_a_kaggle_model_upload_that_never_answers_is_one_line_and_the_eval_goes_on(session, monkeypatch):
    import threading

    from shared.kaggle import models

    release = threading.Event()

    class HangingApi:
        def model_instance_version_create(self, *args, **kwargs):
            release.wait(30)  # a connection that never answers (released when the test ends)

    monkeypatch.setattr(models, "candidates", lambda: [])
    monkeypatch.setattr(models, "kaggle_api", lambda from_secrets: HangingApi())
    try:
        with pytest.raises(UserError) as err:
            models.upload_kaggle_model(session, "alice/gpt2/pyTorch/base", "step 10", log=lambda _: None,
                                       limit_s=0.2)
    finally:
        release.set()
    assert str(err.value) == ("--kaggle-model alice/gpt2/pyTorch/base: the upload gave no answer within 0.2 s; "
                              "the evaluation goes on")


def test_a_kaggle_model_upload_tries_a_5xx_again_and_never_reads_it_as_a_missing_model(session, monkeypatch):
    from shared.kaggle import calls, models

    answers, made = [Reply(503), Reply(502)], []

    class FlakyApi:
        def model_instance_version_create(self, handle, folder, version_notes, quiet):
            if answers:
                raise answers.pop(0)
            made.append(("version", handle, version_notes))

        def model_create_new(self, folder):
            made.append(("model", folder))

    monkeypatch.setattr(calls, "FIRST_WAIT_S", 0.01)
    monkeypatch.setattr(models, "candidates", lambda: [])
    monkeypatch.setattr(models, "kaggle_api", lambda from_secrets: FlakyApi())
    lines = []
    models.upload_kaggle_model(session, "alice/gpt2/pyTorch/base", "step 10", log=lines.append)
    assert made == [("version", "alice/gpt2/pyTorch/base", "step 10")]  # no model created over a passing fault
    assert [line.split(";")[0] for line in lines[:2]] == [
        "notice: uploading a version of Kaggle Model alice/gpt2/pyTorch/base failed (HTTP 503)",
        "notice: uploading a version of Kaggle Model alice/gpt2/pyTorch/base failed (HTTP 502)"]
    assert lines[2] == f"uploaded {session} as a new version of Kaggle Model alice/gpt2/pyTorch/base"


def test_a_checkpoint_fetch_tries_a_5xx_again_within_its_time(monkeypatch, tmp_path):
    import sys
    from types import SimpleNamespace

    from shared.kaggle import bootstrap, calls

    answers = [Reply(500), ConnectionResetError("reset by peer")]

    def download(handle, output_dir):
        if answers:
            raise answers.pop(0)
        Path(output_dir).mkdir(parents=True)
        return output_dir

    monkeypatch.setitem(sys.modules, "kagglehub", SimpleNamespace(dataset_download=download))
    monkeypatch.setattr(calls, "FIRST_WAIT_S", 0.01)
    lines = []
    got = bootstrap.fetch_dataset_version("alice/run-checkpoints", 3, tmp_path / "fetch", log=lines.append)
    assert got == tmp_path / "fetch" and got.is_dir()
    assert [line.split(";")[0] for line in lines] == [
        "notice: fetching version 3 of alice/run-checkpoints failed (HTTP 500)",
        "notice: fetching version 3 of alice/run-checkpoints failed (ConnectionResetError)"]
    # A fault no try mends is one line at once, with its status.
    monkeypatch.setitem(sys.modules, "kagglehub", SimpleNamespace(
        dataset_download=lambda handle, output_dir: (_ for _ in ()).throw(Reply(404))))
    with pytest.raises(UserError):
        bootstrap.fetch_dataset_version("alice/run-checkpoints", 4, tmp_path / "fetch4", log=lines.append)
    assert len(lines) == 2


# bytes, as the chain bakes them; MBs, so the session's own facts file (the image's packages) leaves room
DISK_NEEDS = {"rotation": 2_000_000, "midway": 1_000_000, "fetch": 2_000_000, "fetched": 1_000_000}


def sized_train_build(expect_step: int = 0, expect_version: int = 0) -> dict:
    build = train_build("{working}/train/checkpoints")  # the same disk as /kaggle/temp here: counted
    build["checkpoint_dataset"].update(disk=DISK_NEEDS, midway_s=3600.0, expect_step=expect_step,
                                       expect_version=expect_version)
    return build


def test_a_temp_disk_too_small_for_the_midway_links_drops_the_midway_publish_and_says_so(session, monkeypatch):
    monkeypatch.setenv("LOCAL_KAGGLE_DISK_BYTES", "2600000")  # the rotation's 2 MB fits, with the midway's 1 MB not
    mount_checkpoint(session, 30)
    lines = []
    built = resolve_build(sized_train_build(), log=lines.append)
    assert built.publish.midway_s == 0.0 and built.publish.input_step == 30
    # free: 2.6 MB less what the session's folders hold already (its facts file)
    assert re.fullmatch(r"notice: /kaggle/temp has 2\.[0-6] MB free of 2\.6 MB, less than this session's peak 3\.0 MB "
                        r"\(checkpoints 2\.0 MB, the midway publish's links 1\.0 MB\): no midway publish this "
                        r"session", lines[-2])
    facts = json.loads((session / "working" / "session-facts.json").read_text())["disk"]
    assert facts["midway_dropped"] is True and facts["planned_peak_bytes"] == 3_000_000
    assert facts["temp"]["total_bytes"] == 2_600_000 and facts["temp"]["working_same_disk"] is True
    monkeypatch.setenv("LOCAL_KAGGLE_DISK_BYTES", str(10**9))  # room for all: the midway publish stays
    assert resolve_build(sized_train_build(), log=lines.append).publish.midway_s == 3600.0


def test_a_temp_disk_too_small_for_the_checkpoints_and_a_fetch_stops_before_fetching_in_one_line(session,
                                                                                                 monkeypatch):
    monkeypatch.setenv("LOCAL_KAGGLE_DISK_BYTES", "2600000")
    mount_checkpoint(session, 30)  # older than the step the chain saw: version 3 would be fetched
    with pytest.raises(UserError) as err:
        resolve_build(sized_train_build(expect_step=40, expect_version=3), log=lambda _: None)
    assert str(err.value).startswith("/kaggle/temp has ")
    assert str(err.value).endswith(" free of 2.6 MB, less than this session needs at once: 3.0 MB (checkpoints "
                                   "2.0 MB, the fetched version 1.0 MB, 2.0 MB while extracted, without the midway "
                                   "publish); stopping before training")
    assert not list((session / "temp").glob("gpt2k-*"))  # nothing fetched, nothing staged
