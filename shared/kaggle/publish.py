"""Inside a Kaggle session: resolve a built kernel's baked settings, stage the checkpoint dataset for resuming,
and publish the session's newest checkpoint as a new version of that dataset.

A checkpoint dataset holds one checkpoint's files flat (model.safetensors, optimizer.safetensors, state.json,
metrics.jsonl, manifest.json; a subfolder's files as `<folder>__<file>`): Kaggle datasets are flat lists of
files, and only the newest checkpoint is uploaded, so a version stays one checkpoint big. The trainer (and the
eval kernel) read a checkpoints root (`step_NNNNNN/` directories), so `stage_checkpoint` links the attached
dataset's files back into such a root under the session's temp folder. Where the mount holds an older checkpoint
than the chain saw (a mount of an older version), the version the chain names is fetched with kagglehub first, and
a session that cannot get it stops before training.

Publishing uses the Kaggle API from inside the session (`enable_internet` must be on), with KAGGLE_USERNAME and
KAGGLE_KEY read from the user's Kaggle secrets. Their values are never printed: any message that leaves this
module has them masked. A failed publish is one line; the checkpoint stays in /kaggle/working, where the chain
script (`scripts/chain_sessions.py`) finds it in the kernel's output and publishes it from outside.

Only the standard library is imported at module level; `kaggle` is imported when publishing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

from shared.errors import UserError

MANIFEST = "manifest.json"
PUBLISH_RECORD = "publish.json"  # written to /kaggle/working: what the session published (read by the chain)
DATASET_METADATA = "dataset-metadata.json"
PLACEHOLDER_FILE = "README.md"  # the only file of a checkpoint dataset that holds no checkpoint yet
CREDENTIAL_NAMES = ("KAGGLE_USERNAME", "KAGGLE_KEY")

_config: dict = {}  # set by the built kernel's bootstrap through configure()
FETCH_TIMEOUT_S = 3600.0  # fetching the expected checkpoint version (a gpt2-xl one is about 18.7 GB)


# --- the checkpoint as a flat folder -------------------------------------------------------------------------

def checkpoint_step(folder: str | os.PathLike) -> int | None:
    """The step of the checkpoint whose files lie in `folder` (from its manifest), or None if there is none."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST).read_text())
        return int(manifest["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def stage_checkpoint(input_dir: str | os.PathLike, dest_root: str | os.PathLike) -> Path | None:
    """Link a flat checkpoint (an attached dataset) into `dest_root/step_NNNNNN/`; returns dest_root, or None when
    `input_dir` holds no checkpoint (a chain's first session)."""
    src = Path(input_dir)
    step = checkpoint_step(src)
    if step is None:
        return None
    dest = Path(dest_root) / f"step_{step:06d}"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != PLACEHOLDER_FILE:
            target = dest / decode_name(f.name)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(f.resolve(), target)
    return Path(dest_root)


# A dataset is a flat list of files; a checkpoint's subfolders (e.g. xla_cache/) travel as "xla_cache__<file>".
NESTED_SEP = "__"


def encode_name(rel: str) -> str:
    return rel.replace("/", NESTED_SEP)


def decode_name(name: str) -> str:
    return name.replace(NESTED_SEP, "/")


def checkpoint_files(folder: str | os.PathLike) -> list[tuple[Path, str]]:
    """(file, flat dataset name) for every file of the checkpoint in `folder`, subfolders included."""
    folder = Path(folder)
    out = []
    for f in sorted(folder.rglob("*")):
        rel = f.relative_to(folder).as_posix()
        if f.is_file() and not any(part.startswith(".") for part in rel.split("/")):
            if NESTED_SEP in rel:
                raise UserError(f"{f}: a checkpoint file name may not contain {NESTED_SEP!r}")
            out.append((f, encode_name(rel)))
    return out


# --- a built kernel's settings ---------------------------------------------------------------------------------

_PLACEHOLDER = re.compile(r"\{(input|working|temp)(?::([^{}]+))?\}")


def resolve_placeholders(value: str, paths) -> str:
    """`{working}`, `{temp}`, `{input}` and `{input:owner/slug}` (an attached source's folder) -> real paths."""
    def sub(m: re.Match) -> str:
        kind, slug = m.group(1), m.group(2)
        if kind == "input" and slug:
            return str(paths.input_dir(slug))
        return str(getattr(paths, kind))

    return _PLACEHOLDER.sub(sub, value)


def resolve_build_settings(build: dict, log=print) -> dict:
    """The settings a built kernel runs with: placeholders resolved against this session's folders, the packages
    it needs that the image lacks installed, publishing checked and configured, and the checkpoint dataset staged
    for resuming. Called by the bootstrap of every built kernel; every check here comes before any work."""
    from shared.kaggle.env import check_tpu_present, in_session, kaggle_paths
    from shared.kaggle.packages import require

    settings = dict(build.get("settings") or {})
    if not in_session():
        if any(isinstance(v, str) and _PLACEHOLDER.search(v) for v in settings.values()):
            raise UserError("this built kernel expects Kaggle's folders: run it on Kaggle or in the local Kaggle")
        return settings
    if build.get("kernel") in ("train", "eval"):
        check_tpu_present(build.get("accelerator") or "", build["kernel"])
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
        return settings
    problem = _check_publishing(settings, paths, log) if ckpt.get("publish") else None
    input_step = _stage_resume(ckpt, settings, paths, log) if ckpt.get("resume_setting") else None
    if ckpt.get("publish"):
        floor = max(input_step or 0, int(ckpt.get("expect_step") or 0))
        configure(dataset=ckpt["dataset"], title=ckpt.get("title") or "", input_step=floor or input_step,
                  problem=problem, delete_old_versions=bool(ckpt.get("delete_old_versions")))
    return settings


def _check_publishing(settings: dict, paths, log) -> str | None:
    """Why this train session could not publish its checkpoints (None if it can). Kept in /kaggle/temp they would
    be lost: stop before training; in /kaggle/working the chain publishes them from the output: a notice."""
    problem = publish_problem(log)
    if problem:
        in_temp = Path(settings.get("checkpoint_dir") or paths.working).resolve().is_relative_to(paths.temp.resolve())
        if in_temp:
            raise UserError(f"this session cannot publish its checkpoints ({problem}), and they would live in "
                            f"{paths.temp}, which is gone when the session ends; stopping before training")
        log(f"notice: this session cannot publish its checkpoint ({problem}); the chain publishes it from the "
            "session's output")
    return problem


def _stage_resume(ckpt: dict, settings: dict, paths, log) -> int | None:
    """Stage the checkpoint dataset for resuming (settings[resume_setting]): the attached copy, or, where that holds
    less than the step the chain expects (a mount of an older version), the expected version fetched. Its step,
    or None."""
    folder = _attached(ckpt["dataset"], paths, log)
    input_step = checkpoint_step(folder) if folder else None
    expect = int(ckpt.get("expect_step") or 0)  # the step the chain saw in the dataset before pushing
    # Starting from less than the chain saw would train again, then publish an older checkpoint over a newer one.
    if expect and (input_step or 0) < expect:
        folder, input_step = _fetch_expected(ckpt, folder, input_step, paths, log)
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


def _fetch_expected(ckpt: dict, folder: Path | None, input_step: int | None, paths, log) -> tuple[Path, int]:
    """The chain's version of the checkpoint dataset (`expect_version`, holding `expect_step`), fetched where the
    mount shows an older one; anything less is one line, never training from an older step."""
    dataset, expect, version = ckpt["dataset"], int(ckpt["expect_step"]), int(ckpt.get("expect_version") or 0)
    seen = f"sees step {input_step}" if input_step else "finds no checkpoint"
    stale = f"checkpoint dataset {dataset} holds step {expect}, but this session {seen} in {folder or 'its inputs'}"
    if not version:
        raise UserError(f"{stale}; not starting over")
    log(f"notice: {stale} (an older version); fetching version {version} with kagglehub")
    try:
        fetched = fetch_dataset_version(dataset, version, paths.temp / f"gpt2k-fetch-v{version}")
    except UserError as err:
        raise UserError(f"{stale}, and version {version} could not be fetched ({err}); not starting over") from None
    step = checkpoint_step(fetched)
    if (step or 0) < expect:
        got = f"step {step}" if step else "no checkpoint"
        raise UserError(f"{stale}, and version {version} fetched with kagglehub holds {got}; not starting over")
    log(f"fetched version {version} of {dataset} (step {step}) into {fetched}")
    return fetched, step


def fetch_dataset_version(dataset: str, version: int, dest: Path) -> Path:
    """Version `version` of `dataset` (owner/slug) as a folder, through kagglehub (in Kaggle's images). In a Kaggle
    notebook kagglehub attaches that exact version under /kaggle/input; elsewhere (the local Kaggle too, through
    KAGGLE_API_ENVIRONMENT) it downloads it into `dest`. Errors are one line, with no secret in it."""
    try:
        _secrets_to_env()
    except UserError:
        pass  # Kaggle's own attach needs none; a download without them fails below, in one line
    try:
        import kagglehub
    except ImportError as err:
        raise UserError(f"kagglehub is not importable ({err})") from None
    handle = f"{dataset}/versions/{version}"
    try:
        return Path(_within(FETCH_TIMEOUT_S, lambda: kagglehub.dataset_download(handle, output_dir=str(dest))))
    except UserError:
        raise
    except Exception as err:  # kagglehub's and requests' own types; masked, one line
        raise UserError(describe_error(err, [os.environ.get("KAGGLE_KEY", "")])) from None


def _within(seconds: float, fn):
    """fn(), or a UserError once it has run `seconds` (it goes on in a daemon thread, gone when the session stops):
    kagglehub's attach in a Kaggle notebook waits for its mount with no limit, and a hung fetch would spend the
    whole session."""
    result: dict = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # handed to the caller's thread
            result["error"] = err

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise UserError(f"no answer within {f'{seconds:g} s' if seconds < 120 else f'{seconds / 60:.0f} minutes'}")
    if "error" in result:
        raise result["error"]
    return result["value"]


def kernel_needs(kernel: str, settings: dict) -> list[tuple[str, str]]:
    """(package, what for) that a kernel with these settings cannot work without (shared.kaggle.packages)."""
    if kernel == "tokenize":
        return [("tiktoken", "tokenizing the corpus")]
    needs = []
    if kernel == "eval":
        if settings.get("hellaswag", "auto") != "off" or settings.get("prompts", "default") != "":
            needs.append(("tiktoken", "HellaSwag and the samples"))
    return needs


def publish_problem(log=print, purpose: str = "publishing checkpoints") -> str | None:
    """Why this session could not publish to Kaggle (a checkpoint, or the eval's Kaggle Model): a secret not
    attached, the kaggle package not to be had; None when it can. Secrets are read, never shown."""
    from shared.kaggle.env import get_secret
    from shared.kaggle.packages import provide

    missing = []
    for name in CREDENTIAL_NAMES:
        try:
            get_secret(name)
        except UserError:
            missing.append(name)
    if missing:
        return (f"the secret{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                f"{'are' if len(missing) > 1 else 'is'} not attached to this notebook: attach "
                f"{'them' if len(missing) > 1 else 'it'} on the notebook's page (Add-ons > Secrets)")
    return provide("kaggle", purpose, log)


# --- publishing -----------------------------------------------------------------------------------------------

def configure(dataset: str, title: str = "", input_step: int | None = None, problem: str | None = None,
              delete_old_versions: bool = False) -> None:
    """Publish this session's final checkpoint to `dataset` (owner/slug) after training (deleting every older
    version where the chain says so: keep_dataset_versions); with `problem` (why this session cannot), only record
    that for the chain, which publishes it from the output."""
    _config.clear()
    _config.update(dataset=dataset, title=title, input_step=input_step, problem=problem,
                   delete_old_versions=delete_old_versions)


def configured_dataset() -> str:
    return _config.get("dataset", "")


def _mask(text: str, secrets: list[str]) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    text = re.sub(r"(?i)(authorization: *basic )\S+", r"\1***", text)
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first[:300]


def describe_error(err: BaseException, secrets: list[str] | None = None) -> str:
    """One line for an API failure, with the HTTP status where there is one and no secret in it."""
    status = getattr(getattr(err, "response", None), "status_code", None)
    detail = ""
    response = getattr(err, "response", None)
    if response is not None:
        try:
            detail = response.json().get("message", "")
        except Exception:
            detail = ""
    text = detail or str(err)
    head = f"HTTP {status}" if status else type(err).__name__
    return f"{head}: {_mask(text, secrets or [])}" if text else head


def kaggle_api(from_secrets: bool = True):
    """An authenticated KaggleApi. In a session the credentials come from the user's secrets (set into this
    process's environment, never printed). Raises UserError naming what is missing."""
    if from_secrets:
        _secrets_to_env()
    import contextlib
    import io

    quiet = io.StringIO()  # `import kaggle` authenticates and prints a page of help when that fails
    try:
        with contextlib.redirect_stdout(quiet):
            from kaggle.api.kaggle_api_extended import KaggleApi
    except ImportError as err:
        raise UserError(f"the kaggle package is not installed ({err})") from None
    api = KaggleApi()
    try:
        with contextlib.redirect_stdout(quiet):
            api.authenticate()
    except SystemExit:
        raise UserError("Kaggle credentials not found: set KAGGLE_USERNAME and KAGGLE_KEY (or ~/.kaggle/kaggle.json; "
                        "in a kernel: the Kaggle secrets KAGGLE_USERNAME and KAGGLE_KEY)") from None
    return api


def _secrets_to_env() -> None:
    """In a session, the user's Kaggle credentials from its secrets into this process's environment (where the
    kaggle client and kagglehub read them; never printed)."""
    from shared.kaggle.env import get_secret, in_session

    if in_session():
        for name in CREDENTIAL_NAMES:
            if not os.environ.get(name):
                os.environ[name] = get_secret(name)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copyfile(src, dst)


def dataset_exists(api, dataset: str) -> bool:
    try:
        api.dataset_status(dataset)
        return True
    except Exception as err:
        if getattr(getattr(err, "response", None), "status_code", None) == 404:
            return False
        raise


def write_dataset_folder(folder: Path, dataset: str, title: str, files: list) -> Path:
    """A fresh upload folder: `files` (paths, or (path, name) pairs; linked, not copied, where possible) and
    dataset-metadata.json."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for item in files:
        f, name = item if isinstance(item, tuple) else (item, Path(item).name)
        _link_or_copy(Path(f), folder / name)
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
                       title: str = "", notes: str = "", delete_old_versions: bool = False) -> dict:
    """Upload the checkpoint in `ckpt_dir` as the newest version of `dataset` (created on first use; with
    `delete_old_versions`, the only version left)."""
    ckpt_dir = Path(ckpt_dir)
    step = checkpoint_step(ckpt_dir)
    if step is None:
        raise UserError(f"{ckpt_dir}: not a checkpoint (no readable {MANIFEST})")
    files = checkpoint_files(ckpt_dir)
    folder = write_dataset_folder(Path(work_dir) / "gpt2k-publish", dataset, title, files)
    action = push_dataset_folder(api, folder, dataset, notes or f"checkpoint at step {step}", delete_old_versions)
    shutil.rmtree(folder, ignore_errors=True)
    return {"dataset": dataset, "step": step, "action": action}


def _write_record(record: dict) -> None:
    from shared.kaggle.env import kaggle_paths

    try:
        path = kaggle_paths().working / PUBLISH_RECORD
        path.write_text(json.dumps(record, indent=1))
    except Exception:  # a record is a convenience for the chain; never fail the session over it
        pass


def after_training(result, log=print) -> dict | None:
    """Called by kernels/train.py after train(): publish the final checkpoint when this build configured a
    checkpoint dataset; a no-op otherwise (local runs, or a kernel built without one). Never raises."""
    dataset = configured_dataset()
    if not dataset:
        return None
    step = getattr(result, "step", None)
    ckpt = getattr(result, "checkpoint", None)
    record = {"dataset": dataset, "step": step, "checkpoint": str(ckpt) if ckpt else None, "published": False,
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    input_step = _config.get("input_step")
    if ckpt is None or step is None:
        record["reason"] = "no checkpoint"
    elif input_step is not None and step <= input_step:
        record["reason"] = f"nothing new: the dataset already holds step {input_step}"
        log(f"publish: {dataset} already holds step {input_step}; nothing new to publish")
    elif _config.get("problem"):
        record["reason"] = _config["problem"]
        log(f"publish: step {step} stays in the kernel output for the chain script to publish")
    else:
        secrets: list[str] = []
        try:
            from shared.kaggle.env import kaggle_paths

            api = kaggle_api()
            secrets = [os.environ.get(n, "") for n in CREDENTIAL_NAMES]
            start = time.monotonic()
            delete_old = bool(_config.get("delete_old_versions"))
            out = publish_checkpoint(api, ckpt, dataset, kaggle_paths().temp, _config.get("title", ""),
                                     delete_old_versions=delete_old)
            record.update(published=True, action=out["action"], seconds=round(time.monotonic() - start, 1),
                          delete_old_versions=delete_old)
            log(f"publish: checkpoint step {step} {out['action']} dataset {dataset} "
                f"in {record['seconds']}s")
        except UserError as err:
            record["reason"] = str(err)
            log(f"warning: could not publish step {step} to {dataset}: {err}; it stays in the kernel output")
        except Exception as err:  # the API's own errors: one line, secrets masked
            secrets += [os.environ.get(n, "") for n in CREDENTIAL_NAMES]
            record["reason"] = describe_error(err, secrets)
            log(f"warning: could not publish step {step} to {dataset} ({record['reason']}); "
                "it stays in the kernel output for the chain script to publish")
    _write_record(record)
    return record
