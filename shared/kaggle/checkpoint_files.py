"""A checkpoint as a Kaggle dataset's files: a dataset is a flat list of files, so a checkpoint's subfolders travel
as `<folder>__<file>` and the stable-phase checkpoint as `stable__<file>`; its manifest says its step and which
files (at which sizes) a version holding it must list. Standard library only."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shared.checkpoint_names import CHECKPOINT_PREFIX, STABLE_DIR
from shared.checkpoint_names import MANIFEST_FILE as MANIFEST
from shared.errors import UserError


def checkpoint_step(folder: str | os.PathLike) -> int | None:
    """The step of the checkpoint whose files lie in `folder` (from its manifest), or None if there is none."""
    return manifest_step(Path(folder) / MANIFEST)


def manifest_step(path: str | os.PathLike) -> int | None:
    """The step a checkpoint manifest file records (whatever its name), or None if it is not readable."""
    try:
        return int(json.loads(Path(path).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


# A dataset is a flat list of files; a checkpoint's subfolders (e.g. xla_cache/) travel as "xla_cache__<file>".
NESTED_SEP = "__"
STABLE_PREFIX = STABLE_DIR + NESTED_SEP  # a dataset's stable-phase checkpoint files: stable__<file>


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


def file_sizes(files: list[tuple[Path, str]]) -> dict[str, int]:
    """{flat dataset name: bytes} of (file, name) pairs: what a version made of them must list."""
    return {name: f.stat().st_size for f, name in files}


def manifest_files(manifest: dict, prefix: str = "") -> dict[str, int | None]:
    """{flat dataset name: bytes} a version holding the checkpoint of `manifest` must list (`prefix`: "stable__"
    for the stable-phase one): every file the manifest names, and the manifest itself (any size)."""
    files: dict[str, int | None] = {prefix + encode_name(name): int(meta["bytes"])
                                    for name, meta in manifest.get("files", {}).items()}
    return {**files, prefix + MANIFEST: None}


def stable_checkpoint(*roots: str | os.PathLike | None) -> Path | None:
    """The newest stable-phase checkpoint (`<root>/stable/step_NNNNNN/` with a readable manifest) across `roots`:
    the session's own, or the one staged from the dataset it resumed from."""
    found = [(checkpoint_step(d), d) for root in roots if root
             for d in (Path(root) / STABLE_DIR).glob(f"{CHECKPOINT_PREFIX}*") if d.is_dir()]
    found = [(step, d) for step, d in found if step is not None]
    return max(found)[1] if found else None
