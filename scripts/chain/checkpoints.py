"""The two checkpoint datasets the train sessions resume from and publish to, in turn: a session resumes from the
one holding the newest proven checkpoint and publishes to the other, whose older versions its one upload may delete
(Kaggle deletes versions only at a create: docs/kaggle-api.md), so that a proven checkpoint is left whatever becomes
of the new version. Their versions (the current one, the step each holds, which of them stay), creating them before
the first session, waiting for a publish to land, and publishing a session's checkpoint from its output when the
session could not."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from scripts.chain.client import ApiFailure, VersionMissing, normalize_single_download
from scripts.chain.context import StageContext
from scripts.chain.storage import private_taken, room_line, storage_plan
from shared.checkpoint_names import CHECKPOINT_PREFIX, STABLE_DIR, checkpoint_name
from shared.errors import UserError
from shared.fsutil import sha256_file
from shared.kaggle.checkpoint_files import (
    STABLE_PREFIX,
    checkpoint_step,
    encode_name,
    manifest_files,
    stable_checkpoint,
)
from shared.kaggle.proof import listed_files, listing_problem
from shared.kaggle.publish import (
    MANIFEST,
    PLACEHOLDER_FILE,
    publish_checkpoint,
    push_dataset_folder,
    write_dataset_folder,
)

MANIFEST_404_TRIES = 4  # reads of a ready version's manifest that Kaggle answers 404 though the version lists it
MANIFEST_404_WAIT_S = 30.0  # the first wait between them; doubled each time (30 + 60 + 120 s)


def dataset_step(ctx: StageContext, ref: str, version: int = 0) -> int:
    """The step of the checkpoint that version `version` of the dataset holds (0: none), read from exactly that
    version; without one, from whatever Kaggle serves as the newest (right after a publish, maybe the previous).
    A version believed ready whose manifest answers 404 is read as holding none only where its own file list
    names other files and not the manifest; where it lists the manifest, or nothing yet (a version is never
    empty: a listing that lags), the download is tried again, and never read as "no checkpoint" (which would
    train the run again from an older step)."""
    dest = ctx.workdir / "dataset-probe"
    wait = MANIFEST_404_WAIT_S
    for attempt in range(MANIFEST_404_TRIES):
        if download_dataset_file(ctx, ref, version, MANIFEST, dest / MANIFEST):
            return checkpoint_step(dest) or 0
        if not version:
            return 0
        files = version_files(ctx, ref, version)
        if files and MANIFEST not in files:
            return 0
        listed = f"lists {MANIFEST}" if files else "lists no files yet"
        if attempt + 1 < MANIFEST_404_TRIES:
            ctx.log(f"notice: version {version} of {ref} {listed}, but its download answered 404; "
                    f"trying again in {wait:.0f} s")
            ctx.client.sleep(wait)
            wait *= 2
    raise UserError(f"dataset {ref}: version {version} {listed}, but {MANIFEST_404_TRIES} downloads of its "
                    f"{MANIFEST} answered 404; not reading that as 'no checkpoint': run the chain again later")


def version_files(ctx: StageContext, ref: str, version: int) -> dict[str, int]:
    """{name: bytes} of version `version`'s files, as Kaggle lists them (every page)."""
    return ctx.client.call(f"dataset {ref}/{version} files", listed_files, ctx.client.api, ref, version)


def version_problem(ctx: StageContext, ref: str, version: int, with_stable: bool = False) -> str | None:
    """Why version `version` of the checkpoint dataset does not hold a whole checkpoint, None where it does: its
    file list (names and sizes; Kaggle lists no hashes) against the manifests it carries, the stable-phase
    checkpoint's too where it lists any of its files or `with_stable` (the publish carried one). A publish whose
    client dropped a file that failed to upload (kaggle 2.2.4) leaves such a version."""
    listed = version_files(ctx, ref, version)
    stable = with_stable or any(name.startswith(STABLE_PREFIX) for name in listed)
    expected: dict[str, int | None] = {}
    for prefix in ("", STABLE_PREFIX) if stable else ("",):
        dest = ctx.workdir / "dataset-proof" / (prefix + MANIFEST)
        if not download_dataset_file(ctx, ref, version, prefix + MANIFEST, dest):
            return f"lacks {prefix + MANIFEST}"
        try:
            expected.update(manifest_files(json.loads(dest.read_text()), prefix))
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"holds an unreadable {prefix + MANIFEST}"
    return listing_problem(expected, listed)


def download_dataset_file(ctx: StageContext, ref: str, version: int, name: str, dest_file: Path) -> bool:
    """File `name` of version `version` of the dataset (0: whatever Kaggle serves as the newest) saved as
    `dest_file`; False where the version has no such file."""
    tmp = dest_file.parent / ".download"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    target = f"{ref}/{version}" if version else ref  # owner/slug/N: kaggle sends datasetVersionNumber N
    try:
        ctx.client.call(f"dataset {target}", ctx.client.api.dataset_download_file, target, name, str(tmp),
                        force=True, quiet=True)
    except ApiFailure as err:
        if err.status == 404:
            return False
        raise
    normalize_single_download(tmp, name)
    dest_file.unlink(missing_ok=True)
    (tmp / name).rename(dest_file)
    shutil.rmtree(tmp, ignore_errors=True)
    return True


def carried_stable(ctx: StageContext, ref: str, version: int, dest: Path) -> Path | None:
    """The stable-phase checkpoint that version `version` of the dataset carries (`stable__<file>`), downloaded
    into `dest/step_NNNNNN/`; None where it carries none."""
    shutil.rmtree(dest, ignore_errors=True)
    manifest = dest / MANIFEST
    if not version or not download_dataset_file(ctx, ref, version, STABLE_PREFIX + MANIFEST, manifest):
        return None
    step = checkpoint_step(dest)
    if step is None:
        return None
    folder = dest / checkpoint_name(step)
    for name in json.loads(manifest.read_text()).get("files", {}):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        if not download_dataset_file(ctx, ref, version, STABLE_PREFIX + encode_name(name), folder / name):
            return None
    folder.mkdir(parents=True, exist_ok=True)
    manifest.rename(folder / MANIFEST)
    return folder if _verify_files(folder) else None


def dataset_head(ctx: StageContext, ref: str) -> tuple[int, int]:
    """(the dataset's current version once ready, the step that version holds); (0, 0) with no dataset."""
    number, _ = ctx.client.dataset_version(ref)
    if not number:
        return 0, 0
    version = ctx.client.wait_dataset_version(ref, number - 1)
    return version, dataset_step(ctx, ref, version)


def checkpoint_refs(ctx: StageContext) -> tuple[str, str]:
    """The chain's two checkpoint datasets (owner/slug): the first, and the second it takes turns with."""
    return ctx.ref(ctx.cfg.slug("checkpoints")), ctx.ref(ctx.cfg.slug("checkpoints-b"))


def publish_target(ctx: StageContext, holder: str | None) -> str:
    """The checkpoint dataset a session publishes to: the one that does not hold the newest proven checkpoint
    (`holder`), so that the versions its publish deletes never include that one; the first where none holds any."""
    first, second = checkpoint_refs(ctx)
    return second if holder == first else first


def newest_proven(ctx: StageContext) -> tuple[str, int, int]:
    """(dataset, version, step) of the newest checkpoint either checkpoint dataset holds: each one's current
    version, once ready and proven whole (`version_problem`), and its step; (the first dataset, its version, 0)
    where neither holds one. A dataset that does not exist, holds no checkpoint, or whose current version never
    became ready, failed or is not whole is passed over, in one notice. Equal steps: the first."""
    found = []
    for ref in checkpoint_refs(ctx):
        number, _ = ctx.client.dataset_version(ref)
        if not number:
            ctx.log(f"notice: checkpoint dataset {ref} does not exist yet; it is passed over")
            continue
        try:
            version = ctx.client.wait_dataset_version(ref, number - 1)
        except UserError as err:  # never ready, failed or deleted: a publish to it that did not land
            ctx.log(f"notice: checkpoint dataset {ref} is passed over: {err}")
            continue
        step = dataset_step(ctx, ref, version)  # a manifest that keeps answering 404 stops the chain, in one line
        problem = version_problem(ctx, ref, version) if step else None
        if problem:  # a publish killed or dropped short of a file: never resumed from
            ctx.log(f"notice: version {version} of checkpoint dataset {ref} {problem}; it is passed over")
        elif step:
            found.append((step, ref, version))
    if not found:
        first = checkpoint_refs(ctx)[0]
        return first, ctx.client.dataset_version(first)[0], 0
    step, ref, version = max(found, key=lambda f: f[0])  # max keeps the first of equals
    return ref, version, step


def _versions_key(ctx: StageContext, ref: str | None) -> str:
    return "checkpoint_versions" if ref in (None, checkpoint_refs(ctx)[0]) else "checkpoint_versions_b"


def known_versions(ctx: StageContext, current: int, ref: str | None = None) -> list[int]:
    """The versions this chain knows to be live in checkpoint dataset `ref` (default: the first), oldest first. A
    state without them (a dataset this chain did not create) counts every number up to `current`: deleting too
    early beats filling the quota."""
    return ctx.state.data.setdefault(_versions_key(ctx, ref), list(range(1, current + 1)))


def session_publishes(ctx: StageContext, current: int, limit_s: float, ref: str | None = None) -> tuple[bool, bool]:
    """(whether the next session's final publish deletes the older versions of `ref`, the dataset it publishes to,
    whose current version is `current`; whether it publishes midway), under the private-dataset quota
    (scripts/chain/storage.py). Kaggle deletes only every older version at once, at a create (docs/kaggle-api.md,
    Old versions), so the publish after which more than keep_dataset_versions would be live in `ref` deletes them
    all with its one upload (also where keeping them would leave no room in the quota for the next create): the
    other checkpoint dataset holds the proven checkpoint the session resumes from. A midway version only where it
    and the final one fit beside those live in both (a session killed before its final publish leaves one more)."""
    first, second = checkpoint_refs(ctx)
    other = second if ref in (None, first) else first
    live = len(known_versions(ctx, current, ref))
    others = len(ctx.state.data.get(_versions_key(ctx, other)) or [])
    taken = int((ctx.state.data.get("private_datasets") or {}).get("taken") or 0)
    plan = storage_plan(ctx.cfg, midway=ctx.cfg.midway_publish_s(limit_s) > 0, taken=taken)
    room = ctx.cfg.dataset_room(taken)
    midway = plan.midway and others + live + 2 <= room  # the midway and the final one
    # Deleting also where keeping would leave no room for the next create (a killed session's midway version stays)
    return live + 1 + midway > plan.keep or others + live + 1 + midway >= room, midway


def read_private_datasets(ctx: StageContext, refs: tuple[str, ...]) -> None:
    """At the chain's start: the user's own private datasets and their sizes (ListDatasets), kept in the state, so
    the checkpoint versions are planned under what is left of the quota (session_publishes); one line where three
    versions no longer fit beside them. A listing that fails is a notice: the whole quota is counted as the
    chain's, as before it was read."""
    try:
        datasets = ctx.client.private_datasets()
    except Exception as err:  # an API or a stand-in without the call: the publishes are still proven one by one
        why = ctx.client.describe(err) if not isinstance(err, UserError) else str(err)
        ctx.log(f"notice: {room_line(ctx.cfg, storage_plan(ctx.cfg), None, refs, why)}")
        return
    taken = private_taken(datasets, refs)
    ctx.state.data["private_datasets"] = {"taken": taken, "datasets": datasets, "read_at": time.time()}
    ctx.state.save()
    ctx.log(f"quota: {room_line(ctx.cfg, storage_plan(ctx.cfg, taken=taken), datasets, refs)}")


def note_version(ctx: StageContext, number: int, deleted_old: bool, ref: str | None = None) -> None:
    """Record a new version of checkpoint dataset `ref` (default: the first) that verified, and whether its publish
    deleted the older ones. Without a delete, every number since the last one known counts as live too: a session
    may have made more than one (its midway publish, shared/kaggle/publish.py MidwayPublish), and deleting early
    beats filling the quota."""
    older = [v for v in known_versions(ctx, number - 1, ref) if v < number]
    since = range((older[-1] if older else number - 1) + 1, number + 1)
    ctx.state.data[_versions_key(ctx, ref)] = [number] if deleted_old else older + list(since)
    ctx.state.save()


def wait_published(ctx: StageContext, ref: str, before: int, what: str) -> int:
    """The version a publish made (newer than `before`), once ready; a publish that reported success but never
    appears is one line: Kaggle answers a create over the private-dataset quota so (kaggle-cli issue 284)."""
    try:
        return ctx.client.wait_dataset_version(ref, before)
    except VersionMissing as err:
        raise UserError(f"{what} reported success, but {err}; a create over the private-dataset quota is answered so "
                        "(kaggle-cli issue 284): free space on Kaggle (or lower keep_dataset_versions), then run the "
                        "chain again") from None


def ensure_checkpoint_dataset(ctx: StageContext, ref: str) -> None:
    """Create a checkpoint dataset with a placeholder, so session 1 can already attach it."""
    if ctx.client.dataset_exists(ref):
        return
    folder = ctx.workdir / "dataset-init"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    readme = folder / PLACEHOLDER_FILE
    readme.write_text(f"# Checkpoints of the {ctx.cfg.name} run\n\nEach version holds the newest checkpoint of "
                      "a training session (model, AdamW state, data position, metrics). Version 1 holds none.\n")
    second = " b" if ref == checkpoint_refs(ctx)[1] else ""  # two datasets of one title, not verified: none
    write_dataset_folder(folder / "upload", ref, f"{ctx.cfg.name} checkpoints{second}", [readme])
    ctx.client.call(f"create dataset {ref}", push_dataset_folder, ctx.client.api, folder / "upload", ref,
                    "no checkpoint yet")
    first = wait_published(ctx, ref, 0, f"creating the checkpoint dataset {ref}")
    note_version(ctx, first, deleted_old=True, ref=ref)  # the first version: nothing older
    ctx.log(f"created the checkpoint dataset {ref}")


def publish_from_output(ctx: StageContext, ref: str, version: int, ckpt_ref: str, out_step: int, reason: str,
                        before: int, delete_old: bool = False, resumed: tuple[str, int] | None = None) -> int:
    """Publish checkpoint `out_step` from the output of version `version` of `ref` to `ckpt_ref` (the session
    saved it but did not publish it, or its publish never appeared), as the version after `before`: its number
    once it verifies, or 0, with a warning, when the output holds no complete copy of it. The stable-phase
    checkpoint goes with it: the session's own from its output, else the one the version it resumed from carries
    (`resumed`: (dataset, version); default version `before` of `ckpt_ref`)."""
    name = checkpoint_name(out_step)
    fallback = ctx.workdir / "fallback"
    shutil.rmtree(fallback, ignore_errors=True)
    got = ctx.client.download_output(
        ref, fallback, pattern=rf"^train/checkpoints/({name}|{STABLE_DIR}/{CHECKPOINT_PREFIX}\d+)/", version=version)
    src = fallback / "train" / "checkpoints" / name
    if not [f for f in got if not f.endswith(".log")]:
        ctx.log(f"  warning: the session's output holds no checkpoint {name} (large models keep theirs in "
                "/kaggle/temp, gone with the session); not published")
        return 0
    if checkpoint_step(src) != out_step or not _verify_files(src):
        ctx.log(f"  warning: the output's checkpoint {name} is incomplete; not published")
        return 0
    stable = stable_checkpoint(fallback / "train" / "checkpoints")
    if stable is not None and not _verify_files(stable):
        ctx.log(f"  warning: the output's stable-phase checkpoint {stable.name} is incomplete; left out")
        stable = None
    stable = stable or carried_stable(ctx, *(resumed or (ckpt_ref, before)), fallback / "carried")
    also = f" with the stable phase's {stable.name}" if stable is not None else ""
    ctx.log(f"  publishing step {out_step}{also} from the kernel output ({reason})")
    return publish_proven(ctx, src, ckpt_ref, before, out_step, stable, delete_old)


def publish_proven(ctx: StageContext, src: Path, ref: str, before: int, step: int, stable: Path | None,
                   delete_old: bool) -> int:
    """Publish checkpoint `src` (with `stable` beside it) as the version after `before`, uploaded once: with
    `delete_old`, the create deletes every older version of `ref` (Kaggle deletes only at a create:
    docs/kaggle-api.md), which never holds the newest proven checkpoint (the other checkpoint dataset does:
    `publish_target`); proven whole (`version_problem`; a short one is published once more, keeping versions).
    -> the version proven whole; one that never is, is one line."""
    return _publish_once(ctx, src, ref, before, step, stable, delete=delete_old)


def _publish_once(ctx: StageContext, src: Path, ref: str, before: int, step: int, stable: Path | None,
                  delete: bool) -> int:
    """One publish of `src` past version `before`, waited for and proven; a version short of a file is published
    once more without deleting."""
    what = f"the chain's publish of step {step} to {ref}"
    for attempt in (1, 2):
        ctx.client.call(f"publish to {ref}", publish_checkpoint, ctx.client.api, src, ref, ctx.workdir,
                        f"{ctx.cfg.name} checkpoints", f"checkpoint at step {step} (published by the chain)",
                        delete_old_versions=delete and attempt == 1, stable=stable)
        new = wait_published(ctx, ref, before, what)
        check_version_step(ctx, ref, new, step)
        problem = version_problem(ctx, ref, new, with_stable=stable is not None)
        if problem is None:
            return new
        ctx.log(f"  warning: version {new} of {ref} {problem}; not accepted" +
                ("; publishing it once more" if attempt == 1 else ""))
        before = new
    raise UserError(f"{what}: version {before} {problem}, twice; the checkpoint is still in the session's output: "
                    "run the chain again")


def check_version_step(ctx: StageContext, ref: str, version: int, step: int) -> None:
    """A published version must hold the step that was published: read back from exactly that version."""
    found = dataset_step(ctx, ref, version)
    if found != step:
        raise UserError(f"dataset {ref}: version {version} holds step {found}, not the step {step} just published; "
                        "see the dataset's page")


def _verify_files(folder: Path) -> bool:
    """The checkpoint's files match its manifest (sizes and sha256)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        for name, meta in manifest["files"].items():
            f = folder / name
            if not f.is_file() or f.stat().st_size != meta["bytes"] or sha256_file(f) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError):
        return False
    return True
