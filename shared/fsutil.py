"""File helpers: hashing, fsync, write-to-temp-then-rename for crash-safe outputs, and links."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

_CHUNK = 8 << 20


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new file in `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, *chunks: bytes) -> None:
    """Write `chunks` (concatenated) to `path` so that a kill at any moment leaves either the old file or the new
    one: written to a hidden `.NAME.tmp` beside it, fsynced, then renamed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        for chunk in chunks:  # several: a shard's header and tokens, without joining 200 MB into one buffer
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """`dst` as a hard link to `src` (checkpoints and datasets are large; a symlink is followed first), or a copy
    where no link can be made (another file system)."""
    try:
        os.link(Path(src).resolve(), dst)
    except OSError:
        shutil.copy2(src, dst)


def link_or_symlink(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """`dst` as a hard link to `src`, or a symlink to it where no hard link can be made (another file system, such
    as a read-only /kaggle/input): never a copy, for files that stay as they are while `dst` is read (a gpt2-xl
    checkpoint is 18.7 GB)."""
    source = Path(src).resolve()
    try:
        os.link(source, dst)
    except OSError:
        os.symlink(source, dst)
