"""The checkpoint dataset the train sessions resume from and publish to: its step, creating it before the first
session, and publishing a session's checkpoint from its output when the session could not."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from scripts.chain.client import ApiFailure, _normalize_single_download
from scripts.chain.context import StageContext
from shared.fsutil import sha256_file
from shared.kaggle.publish import (
    MANIFEST,
    PLACEHOLDER_FILE,
    checkpoint_step,
    publish_checkpoint,
    push_dataset_folder,
    write_dataset_folder,
)


def dataset_step(ctx: StageContext, ref: str) -> int:
    """The step of the checkpoint the dataset's newest version holds (0: none yet)."""
    dest = ctx.workdir / "dataset-probe"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    try:
        ctx.client.call(f"dataset {ref}", ctx.client.api.dataset_download_file, ref, MANIFEST, str(dest), force=True,
                        quiet=True)
    except ApiFailure as err:
        if err.status == 404:
            return 0
        raise
    _normalize_single_download(dest, MANIFEST)
    return checkpoint_step(dest) or 0


def ensure_checkpoint_dataset(ctx: StageContext, ref: str) -> None:
    """Create the checkpoint dataset with a placeholder, so session 1 can already attach it."""
    if ctx.client.dataset_exists(ref):
        return
    folder = ctx.workdir / "dataset-init"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    readme = folder / PLACEHOLDER_FILE
    readme.write_text(f"# Checkpoints of the {ctx.cfg.name} run\n\nEach version holds the newest checkpoint of "
                      "a training session (model, AdamW state, data position, metrics). Version 1 holds none.\n")
    write_dataset_folder(folder / "upload", ref, f"{ctx.cfg.name} checkpoints", [readme])
    ctx.client.call(f"create dataset {ref}", push_dataset_folder, ctx.client.api, folder / "upload", ref,
                    "no checkpoint yet")
    ctx.client.wait_dataset_ready(ref)
    ctx.log(f"created the checkpoint dataset {ref}")


def publish_from_output(ctx: StageContext, ref: str, version: int, ckpt_ref: str, out_step: int, reason: str) -> bool:
    """Publish checkpoint `out_step` from the output of version `version` of `ref` to `ckpt_ref` (the session
    saved it but did not publish it); False, with a warning, when the output holds no complete copy of it."""
    name = f"step_{out_step:06d}"
    fallback = ctx.workdir / "fallback"
    shutil.rmtree(fallback / name, ignore_errors=True)
    got = ctx.client.download_output(ref, fallback, pattern=rf"^train/checkpoints/{name}/", version=version)
    src = fallback / "train" / "checkpoints" / name
    if not [f for f in got if not f.endswith(".log")]:
        ctx.log(f"  warning: the session's output holds no checkpoint {name} (large models keep theirs in "
                "/kaggle/temp, gone with the session); not published")
        return False
    if checkpoint_step(src) != out_step or not _verify_files(src):
        ctx.log(f"  warning: the output's checkpoint {name} is incomplete; not published")
        return False
    ctx.log(f"  publishing step {out_step} from the kernel output ({reason})")
    ctx.client.call(f"publish to {ckpt_ref}", publish_checkpoint, ctx.client.api, src, ckpt_ref, ctx.workdir,
                    f"{ctx.cfg.name} checkpoints", f"checkpoint at step {out_step} (published by the chain)")
    ctx.client.wait_dataset_ready(ckpt_ref)
    return True


def _verify_files(folder: Path) -> bool:
    """The checkpoint's files match its manifest (sizes and sha256)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
        for name, meta in manifest["files"].items():
            f = folder / name
            if not f.is_file() or f.stat().st_size != meta["bytes"] or sha256_file(f) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError):
        return False
    return True
