"""A built kernel's bootstrap inside a Kaggle session: its baked settings resolved against the session's folders,
the packages it needs installed, publishing checked, and the checkpoint dataset staged for resuming. Every check
comes before any work. What the train kernel publishes after training comes back with the settings
(`BuiltKernel.publish`), for `shared.kaggle.publish.after_training`.

The trainer (and the eval kernel) read a checkpoints root (`step_NNNNNN/` directories), so `stage_checkpoint` links
the attached dataset's flat files back into such a root under the session's temp folder (the stable-phase
checkpoint's `stable__<file>` into `stable/step_NNNNNN/`, where --extend looks). Where the mount holds an
older checkpoint than the chain saw (a mount of an older version; with --extend, any other step), the version the
chain names is fetched with kagglehub first, and a session that cannot get it stops before training.

Only the standard library is imported at module level.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from shared.checkpoint_names import STABLE_DIR, checkpoint_name
from shared.errors import UserError, describe_error, duration_text, within
from shared.kaggle.calls import kaggle_call
from shared.kaggle.checkpoint_files import checkpoint_step, decode_name, manifest_step
from shared.kaggle.credential import (
    CANNOT_PUBLISH,
    Choice,
    choose_credential,
    publish_until,
    secret_values,
    secrets_to_env,
)
from shared.kaggle.disk import DiskRoom
from shared.kaggle.publish import MANIFEST, PLACEHOLDER_FILE, PublishPlan, publish_problem
from shared.session_clock import seconds_left

CACHE_OFF_ENV = "DISABLE_KAGGLE_CACHE"  # kagglehub: download over HTTP instead of attaching
FETCH_TIMEOUT_S = 3600.0  # fetching the expected checkpoint version (a gpt2-xl one is about 18.7 GB)


@dataclass
class BuiltKernel:
    """What a built kernel runs with: its settings (defaults for the kernel's flags) and, for a train kernel built
    with a checkpoint dataset, what to publish after training."""

    settings: dict
    publish: PublishPlan | None = None


def stage_checkpoint(input_dir: str | os.PathLike, dest_root: str | os.PathLike) -> Path | None:
    """Link a flat checkpoint (an attached dataset) into `dest_root/step_NNNNNN/`, and the stable-phase checkpoint
    it carries, if any, into `dest_root/stable/step_MMMMMM/`; returns dest_root, or None when `input_dir` holds no
    checkpoint (a chain's first session)."""
    src = Path(input_dir)
    step = checkpoint_step(src)
    if step is None:
        return None
    stable_prefix = f"{STABLE_DIR}/"
    files = [(f, decode_name(f.name)) for f in src.iterdir() if f.is_file() and f.name != PLACEHOLDER_FILE]
    stable = [(f, rel[len(stable_prefix):]) for f, rel in files if rel.startswith(stable_prefix)]
    stable_manifest = dict((rel, f) for f, rel in stable).get(MANIFEST)
    stable_step = manifest_step(stable_manifest) if stable_manifest else None
    if stable_step is not None:
        _link_all(stable, Path(dest_root) / STABLE_DIR / checkpoint_name(stable_step))
    _link_all([(f, rel) for f, rel in files if not rel.startswith(stable_prefix)],
              Path(dest_root) / checkpoint_name(step))
    return Path(dest_root)


def _link_all(files: list[tuple[Path, str]], dest: Path) -> None:
    """Symlink each (file, relative name) into `dest`, made afresh."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f, rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(f.resolve(), target)


_PLACEHOLDER = re.compile(r"\{(input|working|temp)(?::([^{}]+))?\}")


def resolve_placeholders(value: str, paths) -> str:
    """`{working}`, `{temp}`, `{input}` and `{input:owner/slug}` (an attached source's folder) -> real paths."""
    def sub(m: re.Match) -> str:
        kind, slug = m.group(1), m.group(2)
        if kind == "input" and slug:
            return str(paths.input_dir(slug))
        return str(getattr(paths, kind))

    return _PLACEHOLDER.sub(sub, value)


def resolve_build(build: dict, log=print) -> BuiltKernel:
    """What a built kernel runs with: its settings with placeholders resolved against this session's folders, the
    packages it needs that the image lacks installed, publishing checked and planned, and the checkpoint dataset
    staged for resuming. Called by the bootstrap of every built kernel; every check here comes before any work."""
    from shared.kaggle.env import check_tpu_present, in_session, kaggle_paths
    from shared.kaggle.packages import require

    settings = dict(build.get("settings") or {})
    if not in_session():
        if any(isinstance(v, str) and _PLACEHOLDER.search(v) for v in settings.values()):
            raise UserError("this built kernel expects Kaggle's folders: run it on Kaggle or in the local Kaggle")
        return BuiltKernel(settings)
    from shared.kaggle.facts import record_clock, record_image

    if build.get("kernel") in ("train", "eval"):
        check_tpu_present(build.get("accelerator") or "", build["kernel"])
    record_clock()
    record_image()  # before any install: the image's own packages
    paths = kaggle_paths()
    settings = {k: resolve_placeholders(v, paths) if isinstance(v, str) else v for k, v in settings.items()}
    for name, reason in kernel_needs(build.get("kernel", ""), settings):
        require(name, reason, log)
    if build.get("kernel") == "eval" and settings.get("kaggle_model"):
        problem = publish_problem(log, "the Kaggle Model upload")
        if problem:
            raise UserError(f"this session cannot upload the Kaggle Model {settings['kaggle_model']} ({problem}); "
                            "stopping before any work")
    ckpt = build.get("checkpoint_dataset")
    if not ckpt:
        return BuiltKernel(settings)
    until = publish_until(settings.get("session_deadline"), float(ckpt.get("publish_s") or 0))
    # The chain resumes from one of its two checkpoint datasets (`dataset`, the newest proven checkpoint) and
    # publishes to the other (`publish_to`), whose older versions the publish may delete.
    target = ckpt.get("publish_to") or ckpt["dataset"]
    problem, chosen = _check_publishing(target, settings, paths, log, until) if ckpt.get("publish") \
        else (None, None)
    room = DiskRoom(ckpt.get("disk"), paths.temp, paths.working, settings.get("checkpoint_dir"),
                    bool(ckpt.get("publish") and ckpt.get("midway_s")), log)
    input_step = _stage_resume(ckpt, settings, paths, log, room) if ckpt.get("resume_setting") else None
    room.check(fetching=False)  # where staging did not check it (no fetch to count)
    if not ckpt.get("publish"):
        return BuiltKernel(settings)
    floor = max(input_step or 0, int(ckpt.get("expect_step") or 0))
    plan = PublishPlan(dataset=target, title=ckpt.get("title") or "", input_step=floor or input_step,
                       problem=problem, delete_old_versions=bool(ckpt.get("delete_old_versions")),
                       resume_root=settings.get(ckpt.get("resume_setting") or "") if input_step else None,
                       extend=bool(settings.get("extend")), verify_s=float(ckpt.get("verify_s") or 0),
                       credential=chosen.credential if chosen else None, reprove=bool(chosen and chosen.reprove),
                       publish_s=float(ckpt.get("publish_s") or 0),
                       midway_s=float(ckpt.get("midway_s") or 0) if room.midway else 0.0,
                       **({"poll_s": tuple(map(float, ckpt["poll_s"]))} if ckpt.get("poll_s") else {}))
    return BuiltKernel(settings, plan)


def _check_publishing(dataset: str, settings: dict, paths, log,
                      needed_until: float | None = None) -> tuple[str | None, Choice | None]:
    """(why this train session could not publish its checkpoints, None) or (None, the credential that proved it
    can, in the first minute: shared/kaggle/credential.py; one expiring before `needed_until`, unix time, is proven
    again before each publish). Kept in /kaggle/temp the checkpoints would be lost: stop before training; in
    /kaggle/working the chain publishes them from the output: a notice."""
    problem = publish_problem(log)
    chosen = None
    if not problem:
        chosen = choose_credential(dataset, log, needed_until)
        problem = chosen.problem
    if chosen and chosen.credential:
        log(f"publishing to {dataset} with {chosen.credential}" + (f" ({chosen.terms})" if chosen.terms else ""))
    if problem:
        in_temp = Path(settings.get("checkpoint_dir") or paths.working).resolve().is_relative_to(paths.temp.resolve())
        if in_temp:
            raise UserError(f"{CANNOT_PUBLISH} ({problem}), and they would live in "
                            f"{paths.temp}, which is gone when the session ends; stopping before training")
        log(f"notice: this session cannot publish its checkpoint ({problem}); the chain publishes it from the "
            "session's output")
    return problem, chosen


def _stage_resume(ckpt: dict, settings: dict, paths, log, room: DiskRoom | None = None) -> int | None:
    """Stage the checkpoint dataset for resuming (settings[resume_setting]): the attached copy, or, where that holds
    less than the step the chain expects (a mount of an older version), the expected version fetched. Its step,
    or None. `room`: the session's disk, checked before any fetch with the fetch counted."""
    folder = _attached(ckpt["dataset"], paths, log)
    input_step = checkpoint_step(folder) if folder else None
    expect = int(ckpt.get("expect_step") or 0)  # the step the chain saw in the dataset before pushing
    # Starting from less than the chain saw would train again, then publish an older checkpoint over a newer one;
    # from more, from a version the chain did not accept (one short of a file: scripts/chain/train_stage.py), or with
    # --extend from the run's end before the extension trained on from its stable phase (the trainer would pass it
    # over and train the extension's steps again).
    fetching = bool(expect and (input_step or 0) != expect)
    if room is not None:
        room.check(fetching)
    if fetching:
        folder, input_step = _fetch_expected(ckpt, folder, input_step, paths, log, settings.get("session_deadline"))
    elif not expect and input_step and int(ckpt.get("expect_version") or 0):
        # The chain accepted no checkpoint yet: one in the mount is a version it refused (a first publish short of
        # a file), which would not load.
        log(f"notice: checkpoint dataset {ckpt['dataset']} holds no checkpoint the chain accepted; step "
            f"{input_step} in {folder} is not one; training from step 0")
        folder, input_step = None, None
    root = stage_checkpoint(folder, paths.temp / "gpt2k-resume") if folder else None
    if root is not None:
        settings[ckpt["resume_setting"]] = str(root)
        log(f"resuming from {ckpt['dataset']} (step {input_step})")
    return input_step


def _attached(dataset: str, paths, log) -> Path | None:
    """The folder the checkpoint dataset is mounted at, None where it is not attached."""
    try:
        return paths.input_dir(dataset)
    except UserError:
        log(f"notice: checkpoint dataset {dataset} is not attached")
        return None


def _fetch_expected(ckpt: dict, folder: Path | None, input_step: int | None, paths, log,
                    session_deadline: float | None = None) -> tuple[Path, int]:
    """The chain's version of the checkpoint dataset (`expect_version`, holding `expect_step`), fetched where the
    mount shows an older one (--extend: another one); anything else is one line, never training from an older
    step. The fetch may take what is left of the session's deadline (counted from the process's start, as the
    trainer counts it), at most FETCH_TIMEOUT_S: a fetch still running there could not leave time to train and
    publish before the kill."""
    dataset, expect, version = ckpt["dataset"], int(ckpt["expect_step"]), int(ckpt.get("expect_version") or 0)
    seen = f"sees step {input_step}" if input_step else "finds no checkpoint"
    stale = f"checkpoint dataset {dataset} holds step {expect}, but this session {seen} in {folder or 'its inputs'}"
    if not version:
        raise UserError(f"{stale}; not starting over")
    left = seconds_left(session_deadline)
    if left <= 0:
        raise UserError(f"{stale}, and the session's deadline ({session_deadline:g} s from its start) has passed "
                        "before the fetch; not starting over")
    cap = min(FETCH_TIMEOUT_S, left)
    until = " (what is left of the session's deadline)" if cap < FETCH_TIMEOUT_S else ""
    which = ("an older version" if (input_step or 0) < expect else
             "another version: one the chain did not accept, or the run's end before --extend trained on below it")
    log(f"notice: {stale} ({which}); fetching version {version} with kagglehub, for at most "
        f"{duration_text(cap)}{until}")
    try:
        fetched = fetch_dataset_version(dataset, version, paths.temp / f"gpt2k-fetch-v{version}", timeout_s=cap,
                                        log=log)
    except UserError as err:
        raise UserError(f"{stale}, and version {version} could not be fetched ({err}{until}); not starting over"
                        ) from None
    step = checkpoint_step(fetched)
    if step != expect:  # the chain's version holds exactly the step it saw there
        got = f"step {step}" if step else "no checkpoint"
        raise UserError(f"{stale}, and version {version} fetched with kagglehub holds {got}; not starting over")
    log(f"fetched version {version} of {dataset} (step {step}) into {fetched}")
    return fetched, step


def fetch_dataset_version(dataset: str, version: int, dest: Path, timeout_s: float | None = None,
                          log=print) -> Path:
    """Version `version` of `dataset` (owner/slug) downloaded over HTTP into `dest`, through kagglehub (in Kaggle's
    images) with its Kaggle-cache resolver off (DISABLE_KAGGLE_CACHE: kagglehub 1.0.3 kaggle_cache_resolver.py
    L104-112, config.py L28, L124). In a notebook that resolver would attach the version as a new datasource
    (AttachDatasourceUsingJwt), which third-party reports say batch sessions cannot do; the download needs only the
    credential in use (the notebook's token, else the attached key). Errors are one line, with no secret in it;
    one that has run `timeout_s` (default FETCH_TIMEOUT_S) stops as "no answer within ...". A transient fault (a
    5xx, a 429, a reset) is tried again within that time (shared/kaggle/calls.py), a notice line each."""
    try:
        secrets_to_env()
    except UserError:
        pass  # the notebook's own token needs none; a download with no credential fails below, in one line
    try:
        import kagglehub
    except ImportError as err:
        raise UserError(f"kagglehub is not importable ({err})") from None
    handle = f"{dataset}/versions/{version}"
    download, env = _kagglehub_download(kagglehub, handle, dest)
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return Path(within(timeout_s or FETCH_TIMEOUT_S,
                           lambda: kaggle_call(download, f"fetching version {version} of {dataset}", log)))
    except UserError:
        raise
    except Exception as err:  # kagglehub's and requests' own types; masked, one line
        raise UserError(describe_error(err, secret_values())) from None
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _kagglehub_download(kagglehub, handle: str, dest: Path):
    """(the call that downloads `handle` into `dest`, the environment it needs). With `output_dir` where kagglehub
    takes it (0.4.3 on: kagglehub 0.4.3 datasets.py L34-40); an older one (Kaggle/docker-python asks only >= 0.4.2,
    kaggle_requirements.txt:74, and the TPU image leaves it unpinned, tpu/requirements.in:38) downloads into its
    cache, put under `dest` (KAGGLEHUB_CACHE, read on each call: kagglehub 0.4.2 config.py L60-63), and returns
    the folder it used there."""
    import inspect

    env = {CACHE_OFF_ENV: "1"}
    try:
        takes_output_dir = "output_dir" in inspect.signature(kagglehub.dataset_download).parameters
    except (TypeError, ValueError):  # no signature to read: the current API
        takes_output_dir = True
    if takes_output_dir:
        return (lambda: kagglehub.dataset_download(handle, output_dir=str(dest))), env
    return (lambda: kagglehub.dataset_download(handle)), {**env, "KAGGLEHUB_CACHE": str(dest)}


def kernel_needs(kernel: str, settings: dict) -> list[tuple[str, str]]:
    """(package, what for) that a kernel with these settings cannot work without (shared.kaggle.packages)."""
    if kernel == "tokenize":
        return [("tiktoken", "tokenizing the corpus")]
    needs = []
    if kernel == "eval":
        if settings.get("hellaswag", "auto") != "off" or settings.get("prompts", "default") != "":
            needs.append(("tiktoken", "HellaSwag and the samples"))
    return needs
