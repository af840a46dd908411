"""A token part's output directory: its shards' names and sizes, and `manifest.json`, rewritten atomically after
every shard so that a killed run can verify what it finished and carry on (see shared/tokenize/part.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from shared.config import GB
from shared.data import HEADER_BYTES
from shared.errors import UserError, describe_error
from shared.fsutil import atomic_write_bytes, fsync_dir, sha256_file
from shared.kaggle.facts import FACTS_FILE
from shared.tokenize.source import same_source

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "gpt2-on-kaggle/tokens/1"
DISK_SLACK = 64 << 20  # free space left on a disk before a shard is written to it


def shard_name(prefix: str, index: int) -> str:
    """The global shard `index` of a corpus: 0 is the validation shard, every other one is training."""
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


def shard_bytes(tokens: int) -> int:
    """A shard's size on disk: the llm.c header, then 2 bytes a token."""
    return HEADER_BYTES + 2 * tokens


def shards_bytes(manifest: dict) -> int:
    """What a manifest's shards take on disk."""
    return sum(shard_bytes(s["tokens"]) for s in manifest["shards"])


def format_bytes(n: float) -> str:
    return f"{n / GB:.3f} GB"


def read_manifest(path: Path, others: str = "refuse") -> dict | None:
    """A token part's manifest. A readable manifest.json of another kind (another dataset's, in the input tree) is an
    error, or None with `others="skip"` (searching a tree of inputs); an unreadable one is always an error."""
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: unreadable manifest ({describe_error(err)})") from None
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        if others == "skip":
            return None
        raise UserError(f"{path}: not a token-part manifest (format {m.get('format') if isinstance(m, dict) else m!r})")
    return m


def write_manifest(out_dir: Path, manifest: dict) -> int:
    manifest["updated"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    data = (json.dumps(manifest, indent=1) + "\n").encode()
    atomic_write_bytes(out_dir / MANIFEST, data)
    return len(data)


def find_prev_manifest(prev_dir: str, part: int) -> dict:
    """Part `part - 1`'s complete manifest, found in `prev_dir` (searched recursively, as Kaggle nests inputs)."""
    want = part - 1
    if not prev_dir:
        raise UserError(f"--part {part} continues part {want}: give part {want}'s output directory with --prev-dir")
    root = Path(prev_dir)
    if not root.is_dir():
        raise UserError(f"--prev-dir {root}: not a directory")
    candidates = [root / MANIFEST] if (root / MANIFEST).is_file() else sorted(root.rglob(MANIFEST))
    found = []
    for path in candidates:
        m = read_manifest(path, others="skip")  # e.g. a checkpoint dataset's manifest.json among the inputs
        if m is not None and m.get("part") == want:
            found.append((path, m))
    if not found:
        raise UserError(f"--prev-dir {root}: no manifest.json of part {want} (needed to continue with part {part})")
    if len(found) > 1:
        raise UserError(f"--prev-dir {root}: several manifests of part {want}: {', '.join(str(p) for p, _ in found)}")
    path, m = found[0]
    if not m.get("complete"):
        raise UserError(f"{path}: part {want} is not finished; run it to the end before part {part}")
    if m.get("stop_reason") == "end_of_stream":
        raise UserError(f"{path}: part {want} already reached the end of the stream; there is no part {part}")
    return m


_IDENTITY = ("part", "shard_size", "tokens_per_part", "prefix", "first_shard_index")


def _check_same_run(path: Path, old: dict, new: dict) -> None:
    for key in _IDENTITY:
        if old.get(key) != new.get(key):
            raise UserError(
                f"--out-dir {path.parent}: holds a run with {key}={old.get(key)!r}, not {new.get(key)!r}; "
                "use an empty directory (or the same settings to resume it)"
            )
    diff = same_source(old["source"], new["source"])
    if diff:
        raise UserError(f"--out-dir {path.parent}: holds a run of another source ({diff}); use an empty directory")
    if (old["start"]["doc"], old["start"]["offset"]) != (new["start"]["doc"], new["start"]["offset"]):
        raise UserError(
            f"--out-dir {path.parent}: holds a run starting at another stream position; use an empty directory"
        )


_SHARD_RE = re.compile(r"(?P<prefix>.+)_(val|train)_(?P<idx>\d{6})\.bin")
_TMP_RE = re.compile(r"\.(manifest\.json|.+_(val|train)_\d{6}\.bin)\.(tmp|partial)")


def clean_leftovers(out_dir: Path, manifest: dict) -> None:
    """Remove what a killed run of ours left: hidden temporaries, and shards moved in but never recorded."""
    listed = {s["name"] for s in manifest["shards"]}
    for entry in out_dir.iterdir():
        name = entry.name
        ours_tmp = _TMP_RE.fullmatch(name) is not None
        m = _SHARD_RE.fullmatch(name)
        unlisted_shard = (m is not None and m["prefix"] == manifest["prefix"] and name not in listed
                          and int(m["idx"]) >= manifest["first_shard_index"] + len(manifest["shards"]))
        if entry.is_file() and (ours_tmp or unlisted_shard):
            entry.unlink()


def verify_shards(out_dir: Path, manifest: dict, log: Callable[[str], None]) -> int:
    """Keep the recorded shards whose sha256 still matches, up to the first one that does not; return kept."""
    shards = manifest["shards"]
    for i, s in enumerate(shards):
        path = out_dir / s["name"]
        ok = path.is_file() and path.stat().st_size == shard_bytes(s["tokens"]) and sha256_file(path) == s["sha256"]
        if not ok:
            log(f"shard {s['name']} is missing or changed; it and the {len(shards) - i - 1} after it are redone")
            for later in shards[i:]:
                p = out_dir / later["name"]
                if p.is_file():
                    p.unlink()
            del shards[i:]
            manifest["complete"], manifest["stop_reason"] = False, None
            break
    return len(shards)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def move_into(src: Path, dest: Path) -> None:
    """Move a finished shard into the output directory; by rename where possible."""
    try:
        os.replace(src, dest)
    except OSError:  # another filesystem: copy under a hidden name, then rename
        partial = dest.with_name(f".{dest.name}.partial")
        shutil.copyfile(src, partial)
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(partial, dest)
        src.unlink()
    fsync_dir(dest.parent)


def inspect_out_dir(out_dir: Path, fresh: dict, log: Callable[[str], None]) -> dict:
    """The manifest to continue: the previous run of this part found in `out_dir`, or `fresh` if it is empty."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out-dir {out_dir}: not a directory")
    path = out_dir / MANIFEST
    if path.is_file():
        old = read_manifest(path)
        _check_same_run(path, old, fresh)
        if fresh["source"]["kind"] == "local":
            for key in ("paths", "empty"):  # the files may have moved (another session)
                old["source"][key] = fresh["source"][key]
        return old
    if out_dir.is_dir() and any(p.name != FACTS_FILE for p in out_dir.iterdir()):  # the session's own notes
        raise UserError(
            f"--out-dir {out_dir}: not empty and not a previous run of this part (no {MANIFEST}); "
            "use an empty directory"
        )
    return fresh
