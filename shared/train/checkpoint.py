"""Preemption-safe checkpoints: one directory per step, written whole or not at all.

    checkpoints/step_000123/
        model.safetensors       fp32 parameters (the tied lm_head is stored once, as wte)
        optimizer.safetensors   AdamW state: "<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step"
                                (Muon's matrices: "<param>.momentum_buffer")
        state.json              step, data-loader position, RNG states, config, versions, timings
        metrics.jsonl           the run's metric history up to this step (so any copy of it can be resumed
                                and reported from, e.g. a Kaggle dataset)
        checkpoint.json         its manifest: the step, sha256 and size of every file above; written last
                                (not manifest.json, a token part's manifest, so a tree holding both reads clearly)

A checkpoint is built in a hidden temporary directory, every file fsynced, then renamed into place, so a
kill at any moment leaves either the previous checkpoint or the new one whole. A checkpoint that fails its
manifest is renamed `corrupt-step_000123` by the trainer (see `latest_checkpoint`), out of resuming and rotation.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.checkpoint_names import (
    CHECKPOINT_PREFIX,
    MANIFEST_FILE,
    METRICS_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    checkpoint_name,
)
from shared.errors import UserError
from shared.fsutil import atomic_write_bytes, fsync_dir, sha256_file
from shared.model_shape import different_shape_error

FORMAT_VERSION = 1
_CORRUPT_PREFIX = "corrupt-"  # a set-aside checkpoint: list_checkpoints ignores it, nothing deletes it
SUPERSEDED_PREFIX = "superseded-"  # set aside by --extend: a shorter schedule's decayed checkpoint

# Checkpoints this process wrote or verified, by path, with the stat of their files then: rotation trusts them
# without hashing gigabytes again at every save.
_known_good: dict[Path, tuple] = {}


def _step_of(path: Path) -> int:
    return int(path.name[len(CHECKPOINT_PREFIX):])


def _files_signature(path: Path) -> tuple | None:
    signature = []
    for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, MANIFEST_FILE):
        try:
            stat = (path / name).stat()
        except OSError:
            return None
        signature.append((name, stat.st_ino, stat.st_size, stat.st_mtime_ns))
    return tuple(signature)


def _remember_good(path: Path) -> None:
    _known_good[path.resolve()] = _files_signature(path)


def _verifies(path: Path) -> bool:
    """Whether `path` matches its manifest; unchanged since this process wrote or verified it counts as yes."""
    signature = _files_signature(path)
    if signature is not None and _known_good.get(path.resolve()) == signature:
        return True
    try:
        good = verify_checkpoint(path) is None
    except OSError:  # unreadable counts as corrupt
        good = False
    if good:
        _remember_good(path)
    return good


def versions() -> dict:
    import numpy
    import safetensors

    out = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
           "safetensors": safetensors.__version__, "format": FORMAT_VERSION}
    if "torch_xla" in sys.modules:
        out["torch_xla"] = sys.modules["torch_xla"].__version__
    return out


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(root: str | os.PathLike, step: int, model_tensors: dict[str, torch.Tensor],
                    optimizer_tensors: dict[str, torch.Tensor], state: dict,
                    metrics_file: str | os.PathLike | None = None, keep: int = 2,
                    extra_dirs: dict[str, str | os.PathLike] | None = None) -> Path:
    """Write checkpoint `step` under `root` atomically, then keep it and the newest `keep` - 1 older checkpoints
    that verify, deleting the older rest; checkpoints of later steps are left alone and never count as kept.

    `extra_dirs` ({name: directory}) are copied in as sub-folders and covered by the manifest too (the XLA
    compilation cache travels this way, so the next session need not compile again).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in model_tensors.items()}, str(tmp / MODEL_FILE))
    save_file({k: v.contiguous() for k, v in optimizer_tensors.items()}, str(tmp / OPTIMIZER_FILE))
    (tmp / STATE_FILE).write_text(json.dumps({**state, "step": step, "versions": versions()}, indent=1))
    if metrics_file is not None and Path(metrics_file).exists():
        shutil.copyfile(metrics_file, tmp / METRICS_FILE)
    for name, src in (extra_dirs or {}).items():
        if Path(src).is_dir():
            shutil.copytree(src, tmp / name)
    files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
    for name in files:
        _fsync_file(tmp / name)
    manifest = {"format": FORMAT_VERSION, "step": step,
                "files": {n: {"sha256": sha256_file(tmp / n), "bytes": (tmp / n).stat().st_size} for n in files}}
    atomic_write_bytes(tmp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
    fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a resumed run ended at once): replace it whole
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    _remember_good(final)
    if keep > 0:
        # A later step is here only if it failed verification and could not be set aside: it must not push a
        # good checkpoint out. Of the older ones a corrupt one never counts as kept (and goes, like any surplus).
        kept = 1
        for older in reversed([p for p in list_checkpoints(root) if _step_of(p) < step]):
            if kept < keep and _verifies(older):
                kept += 1
            else:
                shutil.rmtree(older, ignore_errors=True)
    return final


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """Finished checkpoint directories under `root`, oldest first (temporary ones are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and p.name[len(CHECKPOINT_PREFIX):].isdigit()]
    return sorted(found, key=_step_of)


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """None if the checkpoint matches its manifest, else a one-line reason."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return f"{path}: missing or unreadable {MANIFEST_FILE}"
    for name in (MODEL_FILE, OPTIMIZER_FILE, STATE_FILE):
        if name not in manifest.get("files", {}):
            return f"{path}: manifest lacks {name}"
    for name, meta in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{path}: {name} is missing"
        if file.stat().st_size != meta["bytes"]:
            return f"{path}: {name} has {file.stat().st_size} bytes, manifest says {meta['bytes']}"
        if sha256_file(file) != meta["sha256"]:
            return f"{path}: {name} fails its sha256 check"
    return None


@dataclass
class LoadedCheckpoint:
    path: Path
    step: int
    state: dict
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]


def load_checkpoint(path: str | os.PathLike) -> LoadedCheckpoint:
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem:
        raise UserError(problem)
    _remember_good(path)
    state = json.loads((path / STATE_FILE).read_text())
    return LoadedCheckpoint(path, int(state["step"]), state, load_file(str(path / MODEL_FILE)),
                            load_file(str(path / OPTIMIZER_FILE)))


def _set_aside(path: Path, prefix: str = _CORRUPT_PREFIX) -> Path:
    """Rename a checkpoint within its root to a name list_checkpoints ignores; OSError if it cannot."""
    target = path.with_name(f"{prefix}{path.name}")
    suffix = 1
    while target.exists():  # set aside before (e.g. the same step written and corrupted again)
        suffix += 1
        target = path.with_name(f"{prefix}{path.name}-{suffix}")
    path.rename(target)
    fsync_dir(path.parent)
    return target


def saved_state(path: str | os.PathLike) -> dict:
    """A checkpoint's state.json ({} where unreadable): what it was trained with, without loading its tensors."""
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def latest_checkpoint(*roots: str | os.PathLike, log=print, set_aside: bool = False,
                      superseded: Callable[[Path], str | None] | None = None) -> LoadedCheckpoint | None:
    """The newest checkpoint that verifies, across `roots`; a corrupt one is reported in one line and skipped.

    With `set_aside` (the trainer, which rotates checkpoints in its root) a corrupt one is also renamed
    `corrupt-step_NNNNNN` in its root, so it is neither resumed nor counted as kept; where the root is read-only
    (a Kaggle dataset) it stays. Readers (eval, export) leave the directories as they are. Nothing is deleted.
    `superseded(path)` names why a checkpoint does not belong to this run any more (--extend: made on a schedule
    that has changed since); such a one is passed over and left where it is (the caller decides). Raises
    UserError when checkpoints exist but none verifies.
    """
    candidates = [p for root in roots if root for p in list_checkpoints(root)]
    candidates.sort(key=_step_of, reverse=True)
    for path in candidates:
        if superseded and superseded(path):
            continue
        problem = verify_checkpoint(path)
        if problem is None:
            return load_checkpoint(path)
        if set_aside:
            set_aside_checkpoint(path, f"skipping corrupt checkpoint: {problem}", _CORRUPT_PREFIX, log, "warning")
        else:
            log(f"warning: skipping corrupt checkpoint: {problem}")
    if candidates:
        raise UserError(f"no checkpoint verifies among {len(candidates)} found under {', '.join(map(str, roots))}")
    return None


def checkpoint_at(path: str | os.PathLike, log=print) -> LoadedCheckpoint | None:
    """The checkpoint `path` names, for a reader (eval, export): a checkpoint directory, which must verify; else a
    run's, the newest that verifies in `path` or `path/checkpoints`; None where neither holds one."""
    path = Path(path)
    if (path / MANIFEST_FILE).exists():
        return load_checkpoint(path)
    return latest_checkpoint(path, path / "checkpoints", log=log)


def set_aside_checkpoint(path: Path, reason: str, prefix: str = SUPERSEDED_PREFIX, log=print,
                         level: str = "notice") -> None:
    """Rename a checkpoint out of resuming and rotation (`<prefix>step_NNNNNN` in its root), in one line with
    `reason`; where it cannot be renamed (a read-only root), the line says so and it stays."""
    try:
        moved = _set_aside(path, prefix)
    except OSError as err:  # a read-only root, or another process of this run moved it first
        log(f"{level}: {reason} (could not set it aside: {err.strerror or err})")
    else:
        log(f"{level}: {reason}; set aside as {moved}")


def check_same_shape(ckpt: LoadedCheckpoint, model_config: dict) -> None:
    """A checkpoint of another model shape is a one-line error (before anything is written)."""
    saved = ckpt.state.get("config", {}).get("model", {})
    differences = {k: (saved.get(k), v) for k, v in model_config.items() if saved.get(k) != v}
    if differences:
        raise different_shape_error(ckpt.path, differences)
