"""Inside a Kaggle session: publish the session's newest checkpoint as a new version of a checkpoint dataset: of
the chain's two, the one it did not resume from (`PublishPlan`), uploaded once even where it deletes older versions.

A checkpoint dataset holds one checkpoint's files flat (model.safetensors, optimizer.safetensors, state.json,
metrics.jsonl, checkpoint.json; a subfolder's files as `<folder>__<file>`): Kaggle datasets are flat lists of
files, and only the newest checkpoint is uploaded, so a version stays one checkpoint big. Once a wsd run has passed
the end of its stable phase, the checkpoint kept there travels beside it (`stable__<file>`), version after
version, so that a chain can still extend the run (--extend) after its decay. Staging such a dataset for resuming
is the bootstrap's (shared/kaggle/bootstrap.py), which also decides what a train session publishes
(`PublishPlan`).

Publishing uses the Kaggle API from inside the session (`enable_internet` must be on), with the credential the
bootstrap proved (shared/kaggle/credential.py): the notebook's own token, or KAGGLE_USERNAME and KAGGLE_KEY read
from the user's Kaggle secrets, whose values are never printed: any message that leaves this module has them
masked. A failed publish is one line; the checkpoint stays in /kaggle/working, where the chain
script (`scripts/chain_sessions.py`) finds it in the kernel's output and publishes it from outside.

Only the standard library is imported at module level; `kaggle` is imported when publishing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from shared.checkpoint_names import MANIFEST_FILE as MANIFEST
from shared.errors import UserError, describe_error, within
from shared.fsutil import link_or_copy, link_or_symlink
from shared.kaggle.calls import calls_end_by, kaggle_call
from shared.kaggle.checkpoint_files import (
    STABLE_PREFIX,
    checkpoint_files,
    checkpoint_step,
    decode_name,
    file_sizes,
    stable_checkpoint,
)
from shared.kaggle.credential import (
    candidates,
    choose_credential,
    fallback_for,
    kaggle_api,
    no_credential_problem,
    secret_values,
    use_credential,
)
from shared.kaggle.proof import (
    VERSION_POLL,
    dataset_version,
    failed_uploads_raise,
    verify_publish,
)

PUBLISH_RECORD = "publish.json"  # written to /kaggle/working: what the session published (read by the chain)
DATASET_METADATA = "dataset-metadata.json"
PLACEHOLDER_FILE = "README.md"  # the only file of a checkpoint dataset that holds no checkpoint yet
# The kaggle client and kagglesdk set no timeout of their own: a create (its uploads included) is given the plan's
# publish margin, or this (reads: shared/kaggle/proof.py STATUS_TIMEOUT_S).
CREATE_TIMEOUT_S = 7200.0


def publish_problem(log=print, purpose: str = "publishing checkpoints") -> str | None:
    """Why this session could not publish to Kaggle (a checkpoint, or the eval's Kaggle Model): no credential (the
    notebook's own token, or the secrets KAGGLE_USERNAME and KAGGLE_KEY), the kaggle package not to be had; None
    when it can. Secrets are read, never shown."""
    from shared.kaggle.packages import provide

    return no_credential_problem() or provide("kaggle", purpose, log)


# --- publishing -----------------------------------------------------------------------------------------------

@dataclass
class PublishPlan:
    """What a train session does with its final checkpoint (decided by the bootstrap, before training): publish it
    to `dataset` (owner/slug) as a new version, unless the session resumed from `input_step` or later; with
    `problem` (why this session cannot publish), only record that for the chain, which publishes it from the
    output. `dataset` is the one of the chain's two checkpoint datasets that does not hold the newest proven
    checkpoint (scripts/chain/checkpoints.py `publish_target`): with `delete_old_versions` the create itself
    deletes that dataset's older versions (keep_dataset_versions), one upload, while the other dataset still holds
    the checkpoint the session resumed from."""

    dataset: str
    title: str = ""
    input_step: int | None = None
    problem: str | None = None
    delete_old_versions: bool = False
    resume_root: str | None = None  # the staged checkpoints root the session resumed from (its stable/ travels on)
    extend: bool = False  # --extend: the session may resume below input_step (from the stable phase) and train on
    verify_s: float = 0.0  # > 0: wait that long for the new version and publish again if it failed (verify_publish)
    credential: str | None = None  # the one the bootstrap proved (shared/kaggle/credential.py); None: the clients'
    reprove: bool = False  # it expires before the session's last publish: proven again just before each publish
    publish_s: float = 0.0  # the chain's publish margin: the session is killed that long after its deadline
    # > 0: the first checkpoint written this long after the session's start is published too, while training goes
    # on (MidwayPublish): where Kaggle starts its clock is not verified, and a kill discards the output.
    midway_s: float = 0.0
    poll_s: tuple[float, float] = VERSION_POLL  # the first and longest wait between reads of a new version


# The wait for a publish whose checkpoint has no other copy (kept in /kaggle/temp, not in the output): a version that
# failed, or never appeared (a create over the quota answers "Ok": kaggle-cli issue 284), is published once more.
TEMP_PUBLISH_VERIFY_S = 600.0


def dataset_exists(api, dataset: str, log=print) -> bool:
    try:
        kaggle_call(lambda: api.dataset_status(dataset), f"reading the status of {dataset}", log)
        return True
    except Exception as err:
        if getattr(getattr(err, "response", None), "status_code", None) == 404:
            return False
        raise


def write_dataset_folder(folder: Path, dataset: str, title: str, files: list) -> Path:
    """A fresh upload folder: `files` (paths, or (path, name) pairs; linked, never copied: the kaggle client
    follows a symlink, kaggle_api_extended.py `upload_files`, os.path.isfile/getsize/open) and
    dataset-metadata.json. The files must stay as they are until the upload is done."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for item in files:
        f, name = item if isinstance(item, tuple) else (item, Path(item).name)
        link_or_symlink(Path(f), folder / name)
    slug = dataset.split("/", 1)[1]
    title = (title or slug.replace("-", " "))[:50]
    if len(title) < 6:
        title = f"{title} checkpoints"
    meta = {"id": dataset, "title": title, "licenses": [{"name": "CC0-1.0"}]}
    (folder / DATASET_METADATA).write_text(json.dumps(meta, indent=1))
    return folder


def push_dataset_folder(api, folder: Path, dataset: str, notes: str, delete_old_versions: bool = False) -> str:
    """Create `dataset` from `folder`, or add a version to it (with `delete_old_versions`, Kaggle deletes every
    older version); returns "created" or "versioned"."""
    with failed_uploads_raise(api):  # never a version without one of the files
        if dataset_exists(api, dataset):
            result = api.dataset_create_version(str(folder), notes, quiet=True, dir_mode="skip",
                                                delete_old_versions=delete_old_versions)
            action = "versioned"
        else:
            result = api.dataset_create_new(str(folder), public=False, quiet=True, dir_mode="skip")
            action = "created"
    error = getattr(result, "error", None)
    if error:
        raise RuntimeError(error)
    return action


def publish_checkpoint(api, ckpt_dir: str | os.PathLike, dataset: str, work_dir: str | os.PathLike,
                       title: str = "", notes: str = "", delete_old_versions: bool = False,
                       stable: str | os.PathLike | None = None) -> dict:
    """Upload the checkpoint in `ckpt_dir` (with the stable-phase checkpoint `stable` beside it, if given) as the
    newest version of `dataset` (created on first use; with `delete_old_versions`, the only version left)."""
    step, files = upload_files(ckpt_dir, stable)
    # A folder of its own each call: an upload given up at its time limit runs on in its thread, and a retry must
    # not rebuild the folder that upload still reads.
    Path(work_dir).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="gpt2k-publish-", dir=work_dir))
    try:
        write_dataset_folder(folder, dataset, title, files)
        action = push_dataset_folder(api, folder, dataset, notes or f"checkpoint at step {step}", delete_old_versions)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return publish_result(dataset, step, action, files, stable)


def upload_files(ckpt_dir: str | os.PathLike, stable: str | os.PathLike | None = None
                 ) -> tuple[int, list[tuple[Path, str]]]:
    """(step, (file, flat dataset name) pairs) of the checkpoint in `ckpt_dir`, with the stable-phase checkpoint
    `stable` beside it where given: what a publish of it uploads."""
    step = checkpoint_step(ckpt_dir)
    if step is None:
        raise UserError(f"{ckpt_dir}: not a checkpoint (no readable {MANIFEST})")
    files = checkpoint_files(ckpt_dir)
    if stable is not None:
        files += [(f, STABLE_PREFIX + name) for f, name in checkpoint_files(stable)]
    return step, files


def publish_result(dataset: str, step: int, action: str, files: list, stable) -> dict:
    return {"dataset": dataset, "step": step, "action": action, "files": file_sizes(files),
            "stable_step": checkpoint_step(stable) if stable is not None else None}


def push_retried(api, dataset: str, push, landed, log=print, before: int | None = None) -> dict:
    """push() (a publish: uploads, then a create), made again after a transient fault, but only where the dataset's
    version is still `before` (default: read first): a create may land and answer a fault all the same (a gateway's
    5xx after the work was done), and another push would then make a second version. A version that landed after
    all is `landed(before)`'s (what the push would have returned), and its proof is the caller's."""
    before = dataset_version(api, dataset, log)[0] if before is None else before
    tried = []

    def once() -> dict:
        if tried and (number := dataset_version(api, dataset, log)[0]) > before:
            log(f"publish: version {number} of {dataset} landed after all; not publishing it again")
            return landed(before)
        tried.append(True)
        return push()

    return kaggle_call(once, f"the publish to {dataset}", log)


def _write_record(record: dict) -> None:
    from shared.kaggle.env import kaggle_paths

    try:
        path = kaggle_paths().working / PUBLISH_RECORD
        path.write_text(json.dumps(record, indent=1))
    except Exception:  # a record is a convenience for the chain; never fail the session over it
        pass


def _publish(plan: PublishPlan, ckpt, step: int, record: dict, log, work_dir: Path | None = None,
             stable: Path | None = None) -> None:
    """Publish checkpoint `ckpt` as `plan` says, with the credential it names; failing with the notebook's token
    (refused, expired, or any other way), once more with the attached key where there is one. Fills `record`.
    `work_dir`: where the upload folder is made (default /kaggle/temp); `stable`: the stable-phase checkpoint to
    carry (default: the one beside `ckpt` or in the checkpoints it resumed from)."""
    from shared.kaggle.env import kaggle_paths

    dataset, delete_old = plan.dataset, plan.delete_old_versions
    credential = _reproven(plan, log) if plan.reprove else plan.credential
    if credential:
        use_credential(credential)
    began = time.monotonic()
    stable = stable or stable_checkpoint(Path(ckpt).parent, plan.resume_root)
    # A deleting publish is proven, whatever its checkpoint's other copies: the versions it deleted are gone.
    proof_s = plan.verify_s or (TEMP_PUBLISH_VERIFY_S if delete_old else 0.0)
    work_dir = work_dir or kaggle_paths().temp
    api, before = None, 0
    measured: list[dict] = []  # each create's upload (shared/kaggle/facts.py: what --plan assumes, measured)

    def create(delete: bool) -> dict:
        pushed = time.monotonic()
        out = within(plan.publish_s or CREATE_TIMEOUT_S, lambda: publish_checkpoint(
            api, ckpt, dataset, work_dir, plan.title, delete_old_versions=delete, stable=stable))
        measured.append(upload_measure(out, time.monotonic() - pushed, delete))
        return out

    def landed(before: int) -> dict:  # what a create that answered a fault yet made its version would have returned
        return publish_result(dataset, step, "versioned" if before else "created", upload_files(ckpt, stable)[1],
                              stable)

    def push(delete: bool, before: int | None = None) -> dict:
        return push_retried(api, dataset, lambda: create(delete), landed, log, before)

    def sign_in_and_push(from_secrets: bool) -> dict:
        nonlocal api, before
        api = kaggle_api(from_secrets=from_secrets)
        before = dataset_version(api, dataset, log)[0]  # for the proof, and for the push's retries
        # One upload: the create deletes this dataset's older versions; the chain's other checkpoint dataset holds
        # the proven checkpoint this session resumed from, whatever becomes of this version.
        return push(delete_old, before)

    try:
        out = sign_in_and_push(from_secrets=credential is None)  # None: a plan made without the bootstrap
    except Exception as err:
        failed = credential or next(iter(candidates()), None)  # None: the one the clients chose, the first
        fallback = fallback_for(failed)
        if fallback is None:
            raise
        why = describe_error(err, secret_values())
        log(f"notice: the publish to {dataset} with {failed} failed ({why}); publishing with {fallback}")
        use_credential(fallback)
        out = sign_in_and_push(from_secrets=False)
    record.update(published=True, action=out["action"], seconds=round(time.monotonic() - began, 1),
                  delete_old_versions=delete_old, deleted_old_versions=False, stable_step=out["stable_step"])
    also = f" (with the stable phase's step {out['stable_step']})" if stable is not None else ""
    log(f"publish: checkpoint step {step}{also} {out['action']} dataset {dataset} in {record['seconds']}s")
    if not proof_s:
        record_publish_facts(measured, None)
        return
    # A version that failed is published once more, keeping versions (the deleting one may have deleted them).
    record.update(verify_publish(api, dataset, before, proof_s, log=log, republish=lambda: push(False),
                                 expected=out["files"], poll=plan.poll_s))
    proven = bool(record["verified_version"]) and not record["republished"]
    ready_s = time.monotonic() - began - record["seconds"] if proven else None  # from the create's return
    # Noted only where the deleting version itself was proven: else the chain counts the older ones as live
    # (deleting early beats filling the quota).
    record["deleted_old_versions"] = delete_old and proven and out["action"] == "versioned"
    record_publish_facts(measured, ready_s)


def upload_measure(out: dict, seconds: float, delete: bool) -> dict:
    """One create as measured: its bytes, its seconds (the upload and the create call), MB/s."""
    size = sum(out["files"].values())
    return {"bytes": size, "seconds": round(seconds, 1), "mb_s": float(f"{size / 1e6 / max(seconds, 1e-3):.4g}"),
            "delete_old_versions": delete}


def record_publish_facts(measured: list[dict], ready_s: float | None) -> None:
    """Each create's upload rate, and for the first the seconds from its create's return until its version was
    proven ready (None where the session did not wait for it, or published again), in the session's facts."""
    from shared.kaggle.facts import append_fact

    for n, entry in enumerate(measured):
        append_fact("publishes", {**entry, "ready_s": round(ready_s, 1) if n == 0 and ready_s is not None
                                  else None})


def _reproven(plan: PublishPlan, log) -> str | None:
    """The credential to publish with where the bootstrap's expires before the session's last publish: proven again
    now, in the same order (the token first while Kaggle still lets it write). Where none passes, the bootstrap's,
    all the same: the publish itself is Kaggle's last word, and the checkpoint may have no other copy."""
    chosen = choose_credential(plan.dataset, log)
    if chosen.credential is None:
        log(f"notice: {chosen.problem}; publishing with {plan.credential} all the same")
        return plan.credential
    if chosen.credential != plan.credential:
        log(f"publishing to {plan.dataset} with {chosen.credential} instead")
    else:
        log(f"publish: {chosen.credential} proven again, just before publishing to {plan.dataset}")
    return chosen.credential


class MidwayPublish:
    """Called after each checkpoint the trainer writes (`train(on_checkpoint=...)`): the first one written at least
    `plan.midway_s` after the session's start is published as a new version while training goes on, keeping every
    older version; the final publish waits for it (`after_training(midway=...)`). Where Kaggle starts a session's
    clock is not verified, and a kill discards /kaggle/working: a session killed before its final publish then
    leaves this checkpoint, not the one it resumed from. The checkpoint is linked into a folder of its own first,
    so the trainer's rotation may delete it while the upload runs; the stable phase's, which nothing rewrites (from
    the read-only /kaggle/input where it was resumed from), is linked or symlinked, never copied on the training
    thread (18.7 GB for gpt2-xl). A publish that fails is one notice, no more."""

    def __init__(self, plan: PublishPlan, started: float, work_dir: Path, log=print):
        self.plan = replace(plan, delete_old_versions=False, verify_s=0.0)  # never deletes; the final one verifies
        self.started, self.work_dir, self.log = started, Path(work_dir), log
        self.thread: threading.Thread | None = None
        self.step: int | None = None
        self.record: dict = {}

    def __call__(self, step: int, ckpt: Path) -> None:
        due = self.plan.midway_s > 0 and time.monotonic() - self.started >= self.plan.midway_s
        if self.step is not None or not due or self.plan.problem:
            return
        self.step = step  # one try a session
        try:
            snapshot, stable = self._stage(Path(ckpt))
        except (OSError, UserError) as err:  # the training goes on: this publish is an extra
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.record["reason"] = f"could not stage it: {err}"
            self.log(f"notice: the midway publish of step {step} could not stage its checkpoint ({err}); the "
                     "session's final publish goes on as planned")
            return
        self.log(f"publish: checkpoint step {step} midway through the session, while training goes on "
                 f"(a kill before the session's end leaves it)")
        self.thread = threading.Thread(target=self._run, args=(step, snapshot, stable), daemon=True,
                                       name="midway-publish")
        self.thread.start()

    def _stage(self, ckpt: Path) -> tuple[Path, Path | None]:
        """The checkpoint's files linked into work_dir (copied only where it lies on another file system: the
        rotation may delete it), and the stable phase's linked or symlinked; subfolders (the XLA compile cache)
        kept."""
        shutil.rmtree(self.work_dir, ignore_errors=True)
        stable = stable_checkpoint(ckpt.parent, self.plan.resume_root)
        sources = [("checkpoint", ckpt, link_or_copy)]
        if stable is not None:
            sources.append(("stable", stable, link_or_symlink))
        for into, source, place in sources:
            for f, name in checkpoint_files(source):
                dest = self.work_dir / into / decode_name(name)
                dest.parent.mkdir(parents=True, exist_ok=True)
                place(f, dest)
        return self.work_dir / "checkpoint", (self.work_dir / "stable" if stable is not None else None)

    def _run(self, step: int, snapshot: Path, stable: Path | None) -> None:
        try:
            _publish(self.plan, snapshot, step, self.record, self.log, work_dir=self.work_dir / "upload",
                     stable=stable)
        except Exception as err:  # the final publish is what counts: one line, secrets masked
            self.record["reason"] = describe_error(err, secret_values())
            self.log(f"notice: the midway publish of step {step} failed ({self.record['reason']}); the session's "
                     "final publish goes on as planned")
        finally:
            shutil.rmtree(self.work_dir, ignore_errors=True)  # its links or copies: gpt2-xl's are 18 GB

    def wait(self) -> None:
        """Until the midway publish (if any) is done: two uploads at once would share neither folder nor order."""
        if self.thread is not None:
            self.thread.join()


# Left between a publish that gives up and the session's kill: writing the record and the process's exit, so that
# Kaggle saves the output (a kill discards /kaggle/working, and with it the checkpoint the chain would publish).
# At most a quarter of the publish margin, which short local sessions keep to seconds.
PUBLISH_EXIT_S = 60.0
PUBLISH_EXIT_SHARE = 0.25


def after_training(result, plan: PublishPlan | None, log=print, session_end: float | None = None,
                   midway: MidwayPublish | None = None) -> dict | None:
    """Called by kernels/train.py after train(): publish the final checkpoint as `plan` (the build's, from the
    bootstrap) says; a no-op without one (local runs, or a kernel built without a checkpoint dataset). With
    `session_end` (the monotonic time the session is killed at), a publish still running PUBLISH_EXIT_S (at most
    a quarter of the publish margin) before it is given up, in one line, so the session ends by itself and its
    output is kept. `midway`: a publish made during training, waited for (within the same limit) first. Never
    raises."""
    if plan is None:
        return None
    dataset = plan.dataset
    step = getattr(result, "step", None)
    ckpt = getattr(result, "checkpoint", None)
    start = getattr(result, "start_step", 0)
    record = {"dataset": dataset, "step": step, "start_step": start, "checkpoint": str(ckpt) if ckpt else None,
              "published": False, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    input_step = plan.input_step
    # New: past the dataset's step, or (--extend, from the stable phase below it) past where this session began.
    extended = (plan.extend and input_step is not None and step is not None and 0 < start < input_step
                and step > start)
    if ckpt is None or step is None:
        record["reason"] = "no checkpoint"
    elif input_step is not None and step <= input_step and not extended:
        record["reason"] = f"nothing new: the dataset already holds step {input_step}"
        log(f"publish: {dataset} already holds step {input_step}; nothing new to publish")
    elif plan.problem:
        record["reason"] = plan.problem
        log(f"publish: step {step} stays in the kernel output for the chain script to publish")
    else:
        def publish() -> None:
            if midway is not None:
                midway.wait()
            _publish(plan, ckpt, step, record, log)

        try:
            if session_end is None:
                publish()
            else:
                exit_s = min(PUBLISH_EXIT_S, PUBLISH_EXIT_SHARE * plan.publish_s)
                calls_end_by(session_end - exit_s)  # no wait between a call's tries runs past the give-up
                try:
                    within(max(session_end - time.monotonic() - exit_s, 1.0), publish)
                finally:
                    calls_end_by(None)
        except UserError as err:
            record["reason"] = str(err)
            log(f"warning: could not publish step {step} to {dataset}: {err}; it stays in the kernel output")
        except Exception as err:  # the API's own errors: one line, secrets masked
            record["reason"] = describe_error(err, secret_values())
            log(f"warning: could not publish step {step} to {dataset} ({record['reason']}); "
                "it stays in the kernel output for the chain script to publish")
    if midway is not None and midway.step is not None:
        record["midway"] = {"step": midway.step, **midway.record}
    _write_record(record)
    return record
