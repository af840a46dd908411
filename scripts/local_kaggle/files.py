"""File helpers for the on-disk state: atomic JSON, sizes, hard links, read-only inputs."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any


def atomic_write_json(path: Path, data: Any, mode: int | None = None) -> None:
    """Write through a temporary file and rename, so a crash leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        if mode is not None:
            os.chmod(tmp, mode)  # before any byte is written: secrets are never readable by others
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path, default: Any) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def dir_size(path: Path) -> int:
    """Bytes under `path`, tolerating files that vanish while it walks (a running kernel writes there)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link (datasets and outputs can be large), or a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def make_read_only(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def make_writable(path: Path) -> None:
    """Folders only, so that a read-only tree can be removed."""
    if not path.exists():
        return
    for dirpath, _dirs, _files in os.walk(path):
        os.chmod(dirpath, 0o755)
