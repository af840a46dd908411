"""Kaggle's rules as the local Kaggle models them (machine shapes, limits, quota weeks, names, session states), and
the settings a server runs them with."""

from __future__ import annotations

import datetime as dt
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ApiError

# Machine shapes Kaggle accepts (kaggle-cli docs, Feb 2026), and what each one counts against.
MACHINE_SHAPES: dict[str, str] = {
    "NvidiaTeslaP100": "gpu",
    "NvidiaTeslaT4": "gpu",
    "NvidiaTeslaT4Highmem": "gpu",
    "NvidiaTeslaA100": "gpu",
    "NvidiaL4": "gpu",
    "NvidiaL4X1": "gpu",
    "NvidiaH100": "gpu",
    "NvidiaRtxPro6000": "gpu",
    "TpuV38": "tpu",
    "Tpu1VmV38": "tpu",
    "TpuV5E8": "tpu",
    "TpuV6E8": "tpu",
}
# Retired shapes are accepted and run on another (kaggle-cli tests/unit/test_kernels_push_retired_accelerator.py
# @13dad8ee). The server's own copy, apart from the chain's (scripts/chain/limits.py): a test of the chain then
# also tests what the chain believes about Kaggle.
SUBSTITUTED_SHAPES = {"TpuV38": "TpuV5E8", "Tpu1VmV38": "TpuV5E8", "NvidiaTeslaP100": "NvidiaTeslaT4"}
# enable_tpu / enable_gpu without a machine_shape: what Kaggle picks is not verified; here the TPU and the "default
# GPU" of kaggle-cli's Sep 2026 accelerator list (docs/kernels.md @13dad8ee).
DEFAULT_TPU_SHAPE = "TpuV5E8"
DEFAULT_GPU_SHAPE = "NvidiaTeslaT4"
DEFAULT_SESSION_LIMIT_S = 9 * 3600  # a Kaggle session runs at most 9 hours (12 h for CPU-only, not modelled)
DEFAULT_WORKING_CAP_BYTES = 20 * 10**9  # /kaggle/working holds 20 GB
DEFAULT_TPU_QUOTA_HOURS = 20.0
DEFAULT_GPU_QUOTA_HOURS = 30.0
DEFAULT_CONCURRENCY = {"tpu": 1, "gpu": 2, "cpu": 5}

TERMINAL = {"COMPLETE", "ERROR", "CANCEL_ACKNOWLEDGED"}  # a kernel version's states that are final
SLUG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
WEEK_S = 7 * 86400
# The interpreters that stand in for Kaggle's images (`bash scripts/setup.sh --kaggle-image`; docs/kaggle-tpu.md):
# each holds its image's versions of the packages the kernels import, and nothing the image lacks. The GPU image is
# the CPU one's package set on Colab's GPU base, so the CPU interpreter stands in for both.
IMAGE_VENVS = {"tpu": ".venv-kaggle-tpu", "gpu": ".venv-kaggle-cpu", "cpu": ".venv-kaggle-cpu"}
REPO = Path(__file__).resolve().parents[2]


def image_pythons(repo: Path = REPO) -> dict[str, str]:
    """The interpreter for each kind of machine: its image's virtualenv where set up, else this Python."""
    found = {kind: repo / venv / "bin" / "python" for kind, venv in IMAGE_VENVS.items()}
    return {kind: str(path) if path.exists() else sys.executable for kind, path in found.items()}


def split_ref(ref: str, what: str) -> tuple[str, str]:
    """'owner/slug' (extra parts, as in 'owner/slug/3', ignored) -> (owner, slug); 400 when it is not one."""
    parts = (ref or "").strip("/").split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ApiError(400, f"{what} {ref!r} is not of the form owner/slug")
    return parts[0], parts[1]


def week_start(ts: float) -> float:
    """Weekly quota resets at Saturday 00:00 UTC."""
    day = dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    days_back = (day.weekday() - 5) % 7  # Monday=0 ... Saturday=5
    return (day - dt.timedelta(days=days_back)).timestamp()


@dataclass
class Settings:
    """The limits a server runs with (the CLI's `serve` options); tests change them on a running server."""

    session_limit_s: float = DEFAULT_SESSION_LIMIT_S
    working_cap_bytes: int = DEFAULT_WORKING_CAP_BYTES
    queue_delay_s: float = 0.3  # how long a pushed version stays QUEUED at least
    dataset_ready_delay_s: float = 0.0  # how long a new dataset version is not yet ready
    concurrency: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_CONCURRENCY))
    pythons: dict[str, str] = field(default_factory=image_pythons)  # what runs a session, per kind of machine


def check_access(user: str, owner: str, private: bool, what: str) -> None:
    """A private dataset or kernel is its owner's alone (403 for anyone else)."""
    if private and owner != user:
        raise ApiError(403, f"Permission denied: {what} is private to {owner!r}")


def check_owner(user: str, record: dict, what: str) -> None:
    """Only the owner changes or deletes a dataset or kernel (403 for anyone else)."""
    if record["owner"] != user:
        raise ApiError(403, f"Permission denied: {what} '{record['ref']}' belongs to {record['owner']!r}")
