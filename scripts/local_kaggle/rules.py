"""Kaggle's rules as the local Kaggle models them, and the failures it can be told to fake.

Here: `ApiError` (an API call's error reply); machine shapes, session and output limits, weekly quota and its
week, names and access checks, session states; the `Settings` a server runs with and the interpreters that stand
in for Kaggle's images; `Faults`, the failures tests inject. Nothing here imports the rest of the package.
"""

from __future__ import annotations

import datetime as dt
import math
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class ApiError(Exception):
    """The one error every part raises: sent to the client as `{"code": status, "message": message}` with HTTP
    `status` (a 3xx as a redirect)."""

    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


# ----- Kaggle's limits -----
#
# The server keeps its own copy of each Kaggle fact below, apart from the client code it tests: MACHINE_SHAPES and
# SUBSTITUTED_SHAPES are scripts/chain/limits.py's MACHINE_SHAPES and RETIRED_SHAPES, the session limit its
# SESSION_MAX_S (shared.config.NINE_HOURS), the /kaggle/working cap its OUTPUT_LIMIT_BYTES, the weekly quota
# scripts/chain/plan.py's WEEKLY_QUOTA_S, TERMINAL scripts/chain/client.py's. It imitates kaggle.com
# independently, so a test of the chain against it also tests what the chain believes about Kaggle; sharing one
# constant would make a wrong belief pass.

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
# @13dad8ee).
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

# ----- the server's settings -----

# The interpreters that stand in for Kaggle's images (`bash scripts/setup.sh --kaggle-image`; docs/kaggle-tpu.md):
# each holds its image's versions of the packages the kernels import, and nothing the image lacks. The GPU image is
# the CPU one's package set on Colab's GPU base, so the CPU interpreter stands in for both.
IMAGE_VENVS = {"tpu": ".venv-kaggle-tpu", "gpu": ".venv-kaggle-cpu", "cpu": ".venv-kaggle-cpu"}
REPO = Path(__file__).resolve().parents[2]


def image_pythons(repo: Path = REPO) -> dict[str, str]:
    """The interpreter for each kind of machine: its image's virtualenv where set up, else this Python."""
    found = {kind: repo / venv / "bin" / "python" for kind, venv in IMAGE_VENVS.items()}
    return {kind: str(path) if path.exists() else sys.executable for kind, path in found.items()}


@dataclass
class Settings:
    """The limits a server runs with (the CLI's `serve` options); tests change them on a running server."""

    session_limit_s: float = DEFAULT_SESSION_LIMIT_S
    working_cap_bytes: int = DEFAULT_WORKING_CAP_BYTES
    queue_delay_s: float = 0.3  # how long a pushed version stays QUEUED at least
    dataset_ready_delay_s: float = 0.0  # how long a new dataset version is not yet ready
    concurrency: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_CONCURRENCY))
    pythons: dict[str, str] = field(default_factory=image_pythons)  # what runs a session, per kind of machine
    # Whether a session's own access token (KAGGLE_API_V1_TOKEN) may write datasets. Kaggle's answer in a batch
    # session is not verified (docs/kaggle-api.md, "Which credential publishes"), so both are modelled.
    notebook_token_writes: bool = True
    # Each session's token stops working this long after it is issued (401), and IntrospectToken says when (`exp`);
    # "session": at the session's end, its own start (before the kernel's process starts) plus its time limit; None:
    # it works until the session ends, and states no `exp`. What lifetime Kaggle gives one is not verified.
    notebook_token_lifetime_s: float | str | None = None
    # The scope each session's token carries (IntrospectToken's `scope`). What scope Kaggle gives one, and which
    # scope a write needs, are not verified: a scope refuses nothing here (notebook_token_writes does).
    notebook_token_scope: str = "resources.admin:*"
    # The private-dataset storage quota: a create that would put its owner's live private versions over it answers
    # "Ok" and lands nothing (kaggle-cli issue 284; Kaggle's size of it is not verified). 0: none.
    private_dataset_quota_bytes: int = 0
    # The disk under a session's /kaggle/working and /kaggle/temp (0: the host's): a session reads it as its disk's
    # size (LOCAL_KAGGLE_DISK_BYTES) and is stopped when its folders hold more. /kaggle/temp's size on Kaggle is not
    # verified.
    disk_bytes: int = 0
    # Whether GetDataset's versions[] carry each version's own `status`: a free string in kagglesdk whose values
    # Kaggle writes there is not verified (docs/kaggle-api.md), so a version with none is modelled too.
    version_status_in_versions: bool = True


# ----- names, time, access -----

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


def utc(ts: float | None) -> dt.datetime | None:
    """A naive UTC datetime, as kagglesdk's DateTimeSerializer writes and reads them ("...Z")."""
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(tzinfo=None)


def is_read(method: str) -> bool:
    """Whether an API method changes nothing (GetDataset, ListDatasetFiles, IntrospectToken, DownloadDataset...)."""
    return method.startswith(("Get", "List", "Download")) or method == "IntrospectToken"


def check_access(user: str, owner: str, private: bool, what: str) -> None:
    """A private dataset or kernel is its owner's alone (403 for anyone else)."""
    if private and owner != user:
        raise ApiError(403, f"Permission denied: {what} is private to {owner!r}")


def check_owner(user: str, record: dict, what: str) -> None:
    """Only the owner changes or deletes a dataset or kernel (403 for anyone else)."""
    if record["owner"] != user:
        raise ApiError(403, f"Permission denied: {what} '{record['ref']}' belongs to {record['owner']!r}")


# ----- injected failures -----

class Faults:
    """Failures injected for tests: HTTP errors on chosen calls, a session that fails to start, a kill at a moment,
    a status call that still describes the previous version; for datasets, status and version calls that still
    describe the previous version, a session that mounts the previous version, and a create that reports success but
    never lands (as one over the private-dataset quota: kaggle-cli issue 284); for uploads, a file whose blob upload
    answers 500 to every PUT, its resume queries too (kaggle 2.2.4 then creates the version without that file).

    HTTP faults match a method name ("SaveKernel"), "Service/Method", "read" (any API call that changes nothing:
    `is_read`), "upload", "download" or "*"; each answers `count` matching calls, or with `for_s` every one for
    that long (a fault that lasts a while); `retry_after` adds a Retry-After header; with `after` the call is served
    first and its reply replaced by the fault (a gateway's 5xx after the work was done). Session faults match a
    kernel ref or "*"; dataset faults a dataset ref or "*"; a failed_upload fault a file name or "*" (count: the
    uploads it fails)."""

    DATASET_KINDS = ("stale_dataset_status", "stale_mount", "lost_publish")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.http: list[dict] = []
        self.session_errors: list[dict] = []
        self.kills: list[dict] = []
        self.stale_statuses: list[dict] = []
        self.datasets: dict[str, list[dict]] = {kind: [] for kind in self.DATASET_KINDS}
        self.failed_uploads: list[dict] = []

    def add(self, fault: dict) -> None:
        kind = fault.get("kind", "http")
        fault = dict(fault)
        fault.setdefault("count", 1)
        with self.lock:
            self._queue(kind, fault).append(fault)

    def _queue(self, kind: str, fault: dict) -> list[dict]:
        """The list a fault of `kind` waits in, its defaults set; 400 for a fault that is not whole."""
        if kind == "http":
            if "match" not in fault or "status" not in fault:
                raise ApiError(400, "an http fault needs match and status")
            if fault.get("for_s") is not None:
                fault["until"], fault["count"] = time.monotonic() + float(fault["for_s"]), math.inf
            return self.http
        if kind == "session_error":
            fault.setdefault("kernel", "*")
            fault.setdefault("message", "Injected fault: the session failed to start")
            return self.session_errors
        if kind == "kill":
            fault.setdefault("kernel", "*")
            fault.setdefault("message", "Injected fault: the session was killed")
            if fault.get("after_s") is None and not fault.get("on_log"):
                raise ApiError(400, "a kill fault needs after_s or on_log")
            return self.kills
        if kind == "stale_status":  # an unlabelled status call answers for the version before the newest
            fault.setdefault("kernel", "*")
            return self.stale_statuses
        if kind == "failed_upload":  # see take_failed_upload
            fault.setdefault("name", "*")
            return self.failed_uploads
        if kind in self.DATASET_KINDS:  # see dataset_versions, mount_version and take_lost_publish
            fault.setdefault("dataset", "*")
            return self.datasets[kind]
        raise ApiError(400, f"unknown fault kind {kind!r}")

    def clear(self) -> None:
        with self.lock:
            self.http.clear()
            self.session_errors.clear()
            self.kills.clear()
            self.stale_statuses.clear()
            self.failed_uploads.clear()
            for faults in self.datasets.values():
                faults.clear()

    @staticmethod
    def _take(items: list[dict], pred: Callable[[dict], bool]) -> dict | None:
        for item in items:
            if pred(item):
                item["count"] -= 1
                if item["count"] <= 0:
                    items.remove(item)
                return item
        return None

    def take_http(self, names: set[str], after: bool = False) -> dict | None:
        """The first HTTP fault matching one of `names` that answers before the call is served (after=False) or
        after it (after=True); one whose `for_s` has passed is dropped."""
        with self.lock:
            now = time.monotonic()
            self.http[:] = [f for f in self.http if f.get("until", math.inf) > now]
            return self._take(self.http, lambda f: bool(f.get("after")) == after and (f["match"] == "*" or
                                                                                      f["match"] in names))

    def take_session_error(self, ref: str) -> dict | None:
        with self.lock:
            return self._take(self.session_errors, lambda f: f["kernel"] in ("*", ref))

    def take_kill(self, ref: str) -> dict | None:
        with self.lock:
            return self._take(self.kills, lambda f: f["kernel"] in ("*", ref))

    def status_version(self, kernel: dict) -> dict:
        """The version an unlabelled status call describes: the newest, or (a stale_status fault) the one before."""
        versions = kernel["versions"]
        if len(versions) > 1:
            with self.lock:
                if self._take(self.stale_statuses, lambda f: f["kernel"] in ("*", kernel["ref"])):
                    return versions[-2]
        return versions[-1]

    def _take_dataset(self, kind: str, ref: str) -> bool:
        with self.lock:
            return self._take(self.datasets[kind], lambda f: f["dataset"] in ("*", ref)) is not None

    def dataset_versions(self, ds: dict, live: list[dict]) -> list[dict]:
        """The live versions a call that names no version sees (GetDatasetStatus, GetDataset, an unversioned
        download): all of them, or (a stale_dataset_status fault, one call each) all but the newest."""
        if len(live) > 1 and self._take_dataset("stale_dataset_status", ds["ref"]):
            return live[:-1]
        return live

    def mount_version(self, ds: dict, ready: list[dict]) -> dict:
        """The version a session mounts: the newest ready one, or (a stale_mount fault) the one before it."""
        if len(ready) > 1 and self._take_dataset("stale_mount", ds["ref"]):
            return ready[-2]
        return ready[-1]

    def take_lost_publish(self, ref: str) -> bool:
        """Whether a create of (a version of) dataset `ref` reports success and lands nothing (a lost_publish
        fault)."""
        return self._take_dataset("lost_publish", ref)

    def take_failed_upload(self, name: str) -> bool:
        """Whether the upload of a file named `name`, starting now, fails (a failed_upload fault)."""
        with self.lock:
            return self._take(self.failed_uploads, lambda f: f["name"] in ("*", name)) is not None
