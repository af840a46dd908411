"""A train session's disk: before training, the bootstrap compares the free space under /kaggle/temp with the most
the session will put there at once, and drops the midway publish, or stops in one line, where it does not fit (a
full disk hours in would lose the checkpoint being written, and with checkpoints in /kaggle/temp every copy of it).

What a session puts there (the chain sizes each part from the model: scripts/chain/storage.py `session_disk`):
- `rotation`: the checkpoints the trainer keeps, and the one it writes before deleting the oldest
  (shared/train/checkpoint.py `save_checkpoint`), where the checkpoint folder is on the same disk as /kaggle/temp;
- `midway`: the midway publish's hard links to the checkpoint it uploads (shared/kaggle/publish.py MidwayPublish):
  once the rotation deletes that checkpoint, the links still hold its blocks until the upload ends;
- `fetch`, `fetched`: a version fetched with kagglehub where the mount is stale (shared/kaggle/bootstrap.py): its
  archive and its extraction at once, then the extraction, which stays for the session (kagglehub 1.0.3
  http_resolver.py L179-189: download the archive, extract it, then delete it).

How large /kaggle/temp is on Kaggle is not verified: each session measures it (shutil.disk_usage) and records it
in its facts. The local Kaggle's disk is LOCAL_KAGGLE_DISK_BYTES (scripts/local_kaggle/rules.py Settings.disk_bytes):
the folders it runs a session in share the host's disk, so the session counts what is under them against that.

Only the standard library is imported.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shared.errors import UserError

LOCAL_DISK_ENV = "LOCAL_KAGGLE_DISK_BYTES"  # set by the local Kaggle where it models a disk smaller than the host's


def disk_needs(checkpoint_bytes: int, version_bytes: int, kept_checkpoints: int, stable: bool) -> dict[str, int]:
    """Bytes of each part a train session puts on disk (module docstring): `kept_checkpoints` kept and one written,
    with the stable-phase one beside them where the run keeps it; one checkpoint's midway links; a version of
    `version_bytes` fetched (its archive and its extraction at once)."""
    return {"rotation": (kept_checkpoints + 1 + int(stable)) * checkpoint_bytes, "midway": checkpoint_bytes,
            "fetch": 2 * version_bytes, "fetched": version_bytes}


def peak_bytes(needs: dict[str, int], fetching: bool, midway: bool, rotation: bool = True) -> int:
    """The most on /kaggle/temp's disk at once: while a fetch extracts, its archive and extraction; then while
    training, the fetched version, the rotation (where on that disk) and the midway links."""
    training = (rotation * needs["rotation"] + midway * needs["midway"] + fetching * needs["fetched"])
    return max(training, needs["fetch"] if fetching else 0)


def _existing(path: Path) -> Path:
    """`path`, or its nearest folder that exists (a checkpoint folder is made when the first checkpoint is)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def same_disk(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return _existing(Path(a)).stat().st_dev == _existing(Path(b)).stat().st_dev


def used_bytes(*roots: Path) -> int:
    """Bytes under `roots`, each file once however many hard links it has (the midway publish links checkpoints)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:  # removed while walking
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def disk_usage(temp: Path, working: Path) -> tuple[int, int]:
    """(free, total) bytes of /kaggle/temp's disk: as the system says, and in the local Kaggle no more than its
    modelled disk less what lies under the session's folders."""
    usage = shutil.disk_usage(_existing(temp))
    modelled = int(os.environ.get(LOCAL_DISK_ENV) or 0)
    if not modelled:
        return usage.free, usage.total
    return max(0, min(usage.free, modelled - used_bytes(temp, working))), modelled


class DiskRoom:
    """The check, made once (`check`) when the bootstrap knows whether it fetches: `midway` says afterwards whether
    the midway publish stays. `needs`: the build's `disk` (no check without it: a build made before the chain sized
    it)."""

    def __init__(self, needs: dict | None, temp: Path, working: Path, checkpoint_dir: str | None, midway: bool,
                 log=print):
        self.needs, self.temp, self.working, self.log = needs, Path(temp), Path(working), log
        self.checkpoint_dir = Path(checkpoint_dir or working)
        self.midway, self.checked = midway, False

    def check(self, fetching: bool) -> None:
        """Compare the free disk with the session's peak; drop the midway publish where that makes it fit, else
        one UserError. Records what it measured (shared/kaggle/facts.py)."""
        if self.checked:
            return
        self.checked = True
        from shared.kaggle.facts import record_fact

        free, total = disk_usage(self.temp, self.working)
        rotation = same_disk(self.checkpoint_dir, self.temp)
        record_fact("disk", "temp", {"free_bytes": free, "total_bytes": total,
                                     "working_same_disk": same_disk(self.working, self.temp)})
        if not self.needs:
            return
        peak = peak_bytes(self.needs, fetching, self.midway, rotation)
        record_fact("disk", "planned_peak_bytes", peak)
        if peak <= free:
            return
        if self.midway and peak_bytes(self.needs, fetching, False, rotation) <= free:
            self.midway = False
            record_fact("disk", "midway_dropped", True)
            self.log(f"notice: /kaggle/temp has {_gb(free)} free of {_gb(total)}, less than this session's peak "
                     f"{_gb(peak)} ({self._parts(fetching, rotation, True)}): no midway publish this session")
            return
        raise UserError(f"/kaggle/temp has {_gb(free)} free of {_gb(total)}, less than this session needs at once: "
                        f"{_gb(peak_bytes(self.needs, fetching, False, rotation))} "
                        f"({self._parts(fetching, rotation, False)}, without the midway publish); stopping before "
                        "training")

    def _parts(self, fetching: bool, rotation: bool, midway: bool) -> str:
        needs = self.needs or {}
        parts = [f"checkpoints {_gb(needs['rotation'])}"] if rotation else []
        if midway:
            parts.append(f"the midway publish's links {_gb(needs['midway'])}")
        if fetching:
            parts.append(f"the fetched version {_gb(needs['fetched'])}, {_gb(needs['fetch'])} while extracted")
        return ", ".join(parts) or "nothing"


def _gb(n: int) -> str:
    """Bytes in words: GB, MB, else bytes (a test's disk is a few kB)."""
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n} bytes"
