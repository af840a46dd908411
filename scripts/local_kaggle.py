#!/usr/bin/env python3
"""A local Kaggle: an HTTP server that the real `kaggle` CLI and kagglesdk talk to unchanged.

The client is pointed at it with environment variables (see `LocalKaggle.client_env`):

    KAGGLE_API_ENVIRONMENT=LOCALHOST   # before `import kaggle`: the client POSTs to http://localhost/api/v1/...
    HTTP_PROXY=http://127.0.0.1:PORT   # ...which the proxy setting delivers to this server, on any port
    NO_PROXY=""                        # localhost must not bypass the proxy
    KAGGLE_USERNAME=... KAGGLE_KEY=... # basic auth, checked against <root>/users.json

Served: kernels push/status/output/logs/list/pull/cancel, datasets create/version/status/files/download/
list/metadata (with the blob upload the client does: StartBlobUpload, then a resumable PUT to a URL on this
server), accelerator quota, token introspection. Each pushed kernel version runs as `python <code_file>` in a
subprocess with Kaggle's filesystem under `<root>/kernels/<owner>/<slug>/<version>/kaggle/`: `input/<slug>/`
(read-only by permissions), `working/` (its output, capped), `temp/`; `shared.kaggle_env` finds them from the
LOCAL_KAGGLE_* variables. Sessions are hard-killed at the session limit and count weekly accelerator quota.
Faults (HTTP errors on chosen calls, a session that errors, a kill at a chosen moment) can be injected for
tests. All state is on disk under --root, so a restarted server keeps datasets, kernel versions and outputs.

The API speaks kagglesdk's own types: each route's request and reply types are read from kagglesdk's service
clients (SDK_ROUTES), a request body is read with the request type's from_dict, and a reply is an instance of
the reply type built through its typed setters (`message`) and written as its JSON (`to_wire`), so a reply
cannot carry a field kagglesdk does not have. docs/kaggle-api.md lists the calls, with sources.

    python scripts/local_kaggle.py serve --root DIR --port N [--session-limit S] [--working-cap-gb G]
        [--quota-hours H] [--gpu-quota-hours H] [--user NAME:KEY ...] [--faults FILE]
    python scripts/local_kaggle.py user-add --root DIR NAME        (key read from stdin)
    python scripts/local_kaggle.py secret-set --root DIR USER NAME  (value read from stdin)

How it differs from Kaggle, on purpose or by necessity:
- KAGGLE_API_ENVIRONMENT is read when `kaggle.api.kaggle_api_extended` is first imported (a class attribute),
  so set it before any `import kaggle`.
- A session's environment carries no Kaggle credentials (read KAGGLE_USERNAME/KAGGLE_KEY with
  `shared.kaggle_env.get_secret`); KAGGLE_API_ENVIRONMENT is set only when enable_internet is true. All its
  HTTP(S) goes through this server, which serves the Kaggle API and refuses every other host (no internet).
- A session killed at the time limit, by quota, by the working cap, by a fault or by a server stop ends as
  ERROR with the reason as failure message, and its /kaggle/working output is discarded; a kernel that exits
  non-zero ends as ERROR and keeps its output. `kernels output` serves the newest finished version.
- Inputs are read-only by permissions only (root can still write them). Python kernels only; notebooks run
  their code cells in order (magics skipped). Concurrent sessions: 1 TPU, 2 GPU, 5 CPU; more wait queued.
- Weekly quota resets Saturday 00:00 UTC; a TPU/GPU push with no quota left returns an error in the push
  response (`Kernel push error: ...`), and a running session is stopped when the quota runs out.
- CancelKernelSession takes a kernelSessionId, as on Kaggle; no reply carries one, so read it from
  `LocalKaggle.session_id(ref)` or <root>/state.json (`versions[].session_id`).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import email.utils
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
import zipfile
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kagglesdk.blobs.services.blob_api_service import BlobApiClient
from kagglesdk.blobs.types.blob_api_service import ApiStartBlobUploadRequest, ApiStartBlobUploadResponse
from kagglesdk.datasets.services.dataset_api_service import DatasetApiClient
from kagglesdk.datasets.types.dataset_api_service import (
    ApiCreateDatasetRequest,
    ApiCreateDatasetResponse,
    ApiCreateDatasetVersionRequestBody,
    ApiDataset,
    ApiDatasetFile,
    ApiDatasetNewFile,
    ApiDatasetVersion,
    ApiDeleteDatasetResponse,
    ApiGetDatasetMetadataResponse,
    ApiGetDatasetStatusResponse,
    ApiListDatasetFilesResponse,
    ApiListDatasetsResponse,
)
from kagglesdk.datasets.types.dataset_enums import DatabundleVersionStatus, DatasetSelectionGroup
from kagglesdk.datasets.types.dataset_types import DatasetInfo, SettingsLicense
from kagglesdk.kaggle_object import KaggleObject
from kagglesdk.kernels.services.kernels_api_service import KernelsApiClient
from kagglesdk.kernels.types.kernels_api_service import (
    ApiAcceleratorQuota,
    ApiCancelKernelSessionResponse,
    ApiDeleteKernelResponse,
    ApiGetAcceleratorQuotaStatisticsResponse,
    ApiGetKernelResponse,
    ApiGetKernelSessionStatusResponse,
    ApiKernelBlob,
    ApiKernelMetadata,
    ApiKernelSessionOutputFile,
    ApiListKernelSessionOutputResponse,
    ApiListKernelsResponse,
    ApiSaveKernelRequest,
    ApiSaveKernelResponse,
)
from kagglesdk.kernels.types.kernels_enums import KernelsListViewType, KernelWorkerStatus
from kagglesdk.security.services.oauth_service import OAuthClient
from kagglesdk.security.types.oauth_service import IntrospectTokenResponse

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
# enable_tpu / enable_gpu without a machine_shape: what Kaggle picks is not verified; here the TPU and the "default
# GPU" of kaggle-cli's Sep 2026 accelerator list (docs/kernels.md @13dad8ee).
DEFAULT_TPU_SHAPE = "TpuV5E8"
DEFAULT_GPU_SHAPE = "NvidiaTeslaT4"
DEFAULT_SESSION_LIMIT_S = 9 * 3600  # a Kaggle session runs at most 9 hours (12 h for CPU-only, not modelled)
DEFAULT_WORKING_CAP_BYTES = 20 * 10**9  # /kaggle/working holds 20 GB
DEFAULT_TPU_QUOTA_HOURS = 20.0
DEFAULT_GPU_QUOTA_HOURS = 30.0
DEFAULT_CONCURRENCY = {"tpu": 1, "gpu": 2, "cpu": 5}

TERMINAL = {"COMPLETE", "ERROR", "CANCEL_ACKNOWLEDGED"}
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", ""}
ADMIN_HEADER = "X-Local-Kaggle-Admin"
SLUG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def _now() -> float:
    return time.time()


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(tzinfo=None).isoformat(timespec="milliseconds") + "Z"


def _utc(ts: float | None) -> dt.datetime | None:
    """A naive UTC datetime, as kagglesdk's DateTimeSerializer writes and reads them ("...Z")."""
    if ts is None:
        return None
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(tzinfo=None)


def _duration(delta: dt.timedelta) -> str:
    """A protobuf Duration in its JSON form ("108000s", "1.500s"), which kagglesdk's TimeDeltaSerializer reads back
    exactly. Its own writer is not used: in kagglesdk 0.1.37 it writes `timedelta.seconds` (30 h -> "21600s", the
    whole days dropped) and a fraction as "1.500.0s", which its reader rejects."""
    whole, micros = divmod(max(0, delta // dt.timedelta(microseconds=1)), 10**6)
    if not micros:
        return f"{whole}s"
    frac = f"{micros:06d}"
    return f"{whole}.{frac[:3] if frac.endswith('000') else frac}s"


def _sdk_routes() -> dict[str, tuple[type, type]]:
    """'service/Method' -> (request type, reply type) of every route of kagglesdk's kernels, datasets, blobs and
    OAuth clients, read from the clients themselves: each method calls
    `http_client.call(service, method, request, reply_type)`."""
    routes = {}

    class Recorder:
        def call(self, service, method, request, response_type):
            routes[f"{service}/{method}"] = (type(request), response_type)

    for client_cls in (KernelsApiClient, DatasetApiClient, BlobApiClient, OAuthClient):
        client = client_cls(Recorder())
        for name in dir(client):
            if not name.startswith("_"):
                getattr(client, name)()
    return routes


SDK_ROUTES = _sdk_routes()


def message(cls: type, **fields) -> KaggleObject:
    """A kagglesdk message with `fields` set through its typed setters: a field the type does not have raises
    AttributeError, a value of the wrong type TypeError. None leaves a field unset."""
    obj = cls()
    for name, value in fields.items():
        if value is not None:
            setattr(obj, name, value)
    return obj


def to_wire(obj: KaggleObject) -> dict:
    """The JSON of a kagglesdk message: `obj.to_dict()` (json names, fields at their default left out, enums by
    name, datetimes as ISO with Z), except that Durations are written by `_duration`."""
    out = {}
    for field in obj._fields:
        value = getattr(obj, field.private_field_name)
        if value is None or value == field.default_value:
            continue
        if isinstance(value, KaggleObject):
            out[field.json_name] = to_wire(value)
        elif isinstance(value, dt.timedelta):
            out[field.json_name] = _duration(value)
        elif isinstance(value, list) and any(isinstance(v, (KaggleObject, dt.timedelta)) for v in value):
            out[field.json_name] = [to_wire(v) if isinstance(v, KaggleObject) else _duration(v) for v in value]
        else:
            out[field.json_name] = field.serializer.to_dict_value(field.field_type, value, True)
    return out


def _http_date(ts: float) -> str:
    return email.utils.formatdate(ts, usegmt=True)


def _atomic_write_json(path: Path, data, mode: int | None = None) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        if mode is not None:
            os.chmod(tmp, mode)
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path, default):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def _week_start(ts: float) -> float:
    """Weekly quota resets at Saturday 00:00 UTC."""
    day = dt.datetime.fromtimestamp(ts, dt.timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    days_back = (day.weekday() - 5) % 7  # Monday=0 ... Saturday=5
    return (day - dt.timedelta(days=days_back)).timestamp()


def _dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _make_read_only(path: Path) -> None:
    for dirpath, _dirs, files in os.walk(path, topdown=False):
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def _make_writable(path: Path) -> None:
    if not path.exists():
        return
    for dirpath, _dirs, _files in os.walk(path):
        os.chmod(dirpath, 0o755)


def _split_ref(ref: str, what: str) -> tuple[str, str]:
    parts = (ref or "").strip("/").split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise ApiError(400, f"{what} {ref!r} is not of the form owner/slug")
    return parts[0], parts[1]


def notebook_to_script(text: str) -> str:
    """The code cells of an .ipynb, in order, as one script (IPython magics skipped, `!cmd` via a shell)."""
    nb = json.loads(text)
    chunks = []
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list):
            source = "".join(source)
        lines = []
        for line in source.splitlines():
            stripped = line.lstrip()
            indent = line[: len(line) - len(stripped)]
            if stripped.startswith("!"):
                lines.append(f"{indent}__import__('subprocess').run({stripped[1:]!r}, shell=True, check=True)")
            elif stripped.startswith("%"):
                lines.append(f"{indent}pass  # magic skipped by the local Kaggle: {stripped}")
            else:
                lines.append(line)
        chunks.append(f"# --- cell {i} ---\n" + "\n".join(lines) + "\n")
    return "\n".join(chunks)


class Faults:
    """Injected failures. HTTP faults match a method name ("SaveKernel"), "Service/Method", "upload",
    "download" or "*"; session faults match a kernel ref or "*"."""

    def __init__(self):
        self.lock = threading.Lock()
        self.http: list[dict] = []
        self.session_errors: list[dict] = []
        self.kills: list[dict] = []

    def add(self, fault: dict) -> None:
        kind = fault.get("kind", "http")
        fault = dict(fault)
        fault.setdefault("count", 1)
        with self.lock:
            if kind == "http":
                if "match" not in fault or "status" not in fault:
                    raise ApiError(400, "an http fault needs match and status")
                self.http.append(fault)
            elif kind == "session_error":
                fault.setdefault("kernel", "*")
                fault.setdefault("message", "Injected fault: the session failed to start")
                self.session_errors.append(fault)
            elif kind == "kill":
                fault.setdefault("kernel", "*")
                fault.setdefault("message", "Injected fault: the session was killed")
                if fault.get("after_s") is None and not fault.get("on_log"):
                    raise ApiError(400, "a kill fault needs after_s or on_log")
                self.kills.append(fault)
            else:
                raise ApiError(400, f"unknown fault kind {kind!r}")

    def clear(self) -> None:
        with self.lock:
            self.http.clear()
            self.session_errors.clear()
            self.kills.clear()

    @staticmethod
    def _take(items: list[dict], pred: Callable[[dict], bool]) -> dict | None:
        for item in items:
            if pred(item):
                item["count"] -= 1
                if item["count"] <= 0:
                    items.remove(item)
                return item
        return None

    def take_http(self, names: set[str]) -> dict | None:
        with self.lock:
            return self._take(self.http, lambda f: f["match"] == "*" or f["match"] in names)

    def take_session_error(self, ref: str) -> dict | None:
        with self.lock:
            return self._take(self.session_errors, lambda f: f["kernel"] in ("*", ref))

    def take_kill(self, ref: str) -> dict | None:
        with self.lock:
            return self._take(self.kills, lambda f: f["kernel"] in ("*", ref))


class Session:
    """A running kernel version."""

    def __init__(self, ref: str, number: int, limit_s: float, kill_fault: dict | None):
        self.ref = ref
        self.number = number
        self.limit_s = limit_s
        self.kill_fault = kill_fault
        self.proc: subprocess.Popen | None = None
        self.started = _now()
        self.kill_reason: str | None = None
        self.kill_status = "ERROR"
        self.log_lock = threading.Lock()
        self.done = threading.Event()

    def kill(self, reason: str, status: str = "ERROR") -> None:
        if self.kill_reason is None:
            self.kill_reason = reason
            self.kill_status = status
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class LocalKaggle:
    """The server, its on-disk state, and the session runner. Start it in a thread with `start()`."""

    def __init__(
        self,
        root: str | os.PathLike,
        port: int = 0,
        host: str = "127.0.0.1",
        session_limit_s: float = DEFAULT_SESSION_LIMIT_S,
        working_cap_bytes: int = DEFAULT_WORKING_CAP_BYTES,
        tpu_quota_hours: float = DEFAULT_TPU_QUOTA_HOURS,
        gpu_quota_hours: float = DEFAULT_GPU_QUOTA_HOURS,
        queue_delay_s: float = 0.3,
        dataset_ready_delay_s: float = 0.0,
        concurrency: dict | None = None,
        python: str = sys.executable,
        users: dict[str, str] | None = None,
        faults: list[dict] | None = None,
        verbose: bool = False,
    ):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.port = port
        self.session_limit_s = float(session_limit_s)
        self.working_cap_bytes = int(working_cap_bytes)
        self.quota_s = {"tpu": tpu_quota_hours * 3600.0, "gpu": gpu_quota_hours * 3600.0}
        self.queue_delay_s = queue_delay_s
        self.dataset_ready_delay_s = dataset_ready_delay_s
        self.concurrency = dict(DEFAULT_CONCURRENCY, **(concurrency or {}))
        self.python = python
        self.verbose = verbose
        self.lock = threading.RLock()
        self.zip_lock = threading.Lock()
        self.faults = Faults()
        self.sessions: dict[tuple[str, int], Session] = {}
        self._stop = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        for sub in ("blobs", "datasets", "kernels", "zips"):
            (self.root / sub).mkdir(exist_ok=True)
        self.state_path = self.root / "state.json"
        self.users_path = self.root / "users.json"
        self.secrets_path = self.root / "secrets.json"
        self.state = _read_json(
            self.state_path, {"format": 1, "next_id": 1, "datasets": {}, "kernels": {}, "uploads": {}}
        )
        admin_path = self.root / "admin_token"
        if not admin_path.exists():
            admin_path.write_text(secrets.token_hex(16))
            os.chmod(admin_path, 0o600)
        self.admin_token = admin_path.read_text().strip()
        for name, key in (users or {}).items():
            self.add_user(name, key)
        for fault in faults or []:
            self.faults.add(fault)
        self._recover()

    # ----- lifecycle -----

    def start(self) -> LocalKaggle:
        handler = type("Handler", (_Handler,), {"app": self})
        self._httpd = ThreadingHTTPServer((self.host, self.port), handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        for target in (self._httpd.serve_forever, self._scheduler):
            t = threading.Thread(target=target, daemon=True, name=f"local-kaggle-{target.__name__}")
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        """Stop serving; running sessions are killed and recorded as errors (as a lost Kaggle VM would be)."""
        self._stop.set()
        with self.lock:
            running = list(self.sessions.values())
        for s in running:
            s.kill("The local Kaggle server stopped while this session was running")
        for s in running:
            s.done.wait(10)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> LocalKaggle:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def serve_forever(self) -> None:
        self.start()
        try:
            while not self._stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client_env(self, user: str | None = None, key: str | None = None) -> dict[str, str]:
        """Environment variables that point the real kaggle CLI / kagglesdk at this server."""
        env = {
            "KAGGLE_API_ENVIRONMENT": "LOCALHOST",
            "HTTP_PROXY": self.proxy_url,
            "http_proxy": self.proxy_url,
            "HTTPS_PROXY": self.proxy_url,  # an accidental https call fails fast here instead of hanging
            "https_proxy": self.proxy_url,
            "NO_PROXY": "",
            "no_proxy": "",
        }
        if user is not None:
            env["KAGGLE_USERNAME"] = user
        if key is not None:
            env["KAGGLE_KEY"] = key
        return env

    def _recover(self) -> None:
        """After a restart: sessions that were running are lost; queued ones run."""
        changed = False
        for kernel in self.state["kernels"].values():
            for v in kernel["versions"]:
                if "session_id" not in v:  # state written before versions had one
                    v["session_id"] = self._next_id()
                    changed = True
                if v["status"] == "RUNNING":
                    v["status"] = "ERROR"
                    v["failure_message"] = "The local Kaggle server stopped while this session was running"
                    v["ended"] = v.get("ended") or _now()
                    v["outputs_saved"] = False
                    changed = True
                elif v["status"] == "QUEUED":
                    v["queued_at"] = _now()
        for tmp in (self.root / "datasets").glob("*/*/.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        if changed:
            self._save()

    def _save(self) -> None:
        with self.lock:
            _atomic_write_json(self.state_path, self.state)

    def _next_id(self) -> int:
        n = self.state["next_id"]
        self.state["next_id"] = n + 1
        return n

    # ----- users and secrets (files, so they can be edited while the server runs) -----

    def users(self) -> dict[str, str]:
        return _read_json(self.users_path, {})

    def add_user(self, name: str, key: str) -> None:
        if not SLUG_RE.match(name):
            raise ValueError(f"bad user name {name!r}")
        with self.lock:
            users = self.users()
            users[name] = key
            _atomic_write_json(self.users_path, users, mode=0o600)

    def set_secret(self, user: str, name: str, value: str) -> None:
        with self.lock:
            store = _read_json(self.secrets_path, {})
            store.setdefault(user, {})[name] = value
            _atomic_write_json(self.secrets_path, store, mode=0o600)

    def _secrets_of(self, user: str) -> dict[str, str]:
        return _read_json(self.secrets_path, {}).get(user, {})

    def authenticate(self, header: str | None) -> str:
        users = self.users()
        if not header:
            raise ApiError(401, "Missing credentials: set KAGGLE_USERNAME and KAGGLE_KEY (or KAGGLE_API_TOKEN)")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic":
            try:
                name, _, key = base64.b64decode(value).decode().partition(":")
            except Exception as err:
                raise ApiError(401, "Malformed basic auth header") from err
            if name not in users:
                raise ApiError(401, f"Unknown user {name!r}")
            if not secrets.compare_digest(users[name], key):
                raise ApiError(401, f"Wrong API key for user {name!r}")
            return name
        if scheme.lower() == "bearer":
            for name, key in users.items():
                if secrets.compare_digest(key, value):
                    return name
            raise ApiError(401, "Invalid or expired access token")
        raise ApiError(401, f"Unsupported authorization scheme {scheme!r}")

    # ----- fault injection and test helpers -----

    def inject(self, kind: str = "http", **fault) -> None:
        """inject("http", match="SaveKernel", status=429, count=1, retry_after=0, message=...)
        inject("session_error", kernel="u/k", message=...)
        inject("kill", kernel="u/k", after_s=1.0 | on_log=r"regex", message=...)"""
        self.faults.add({"kind": kind, **fault})

    def kill_session(self, ref: str, reason: str = "Killed by the local Kaggle operator") -> bool:
        with self.lock:
            running = [s for (r, _), s in self.sessions.items() if r == ref]
        for s in running:
            s.kill(reason)
        return bool(running)

    def session_id(self, ref: str, number: int | None = None) -> int:
        """The kernelSessionId of a version (default: the newest), which CancelKernelSession takes. No reply
        carries it (as on Kaggle: see docs/kaggle-api.md); it is in <root>/state.json too."""
        with self.lock:
            versions = self._kernel(ref)["versions"]
            v = versions[-1] if number is None else next(x for x in versions if x["number"] == number)
            return v["session_id"]

    def kernel_status(self, ref: str) -> tuple[str, str | None]:
        with self.lock:
            v = self._kernel(ref)["versions"][-1]
            return v["status"], v.get("failure_message")

    def wait_kernel(self, ref: str, timeout: float = 60.0) -> tuple[str, str | None]:
        deadline = _now() + timeout
        while True:
            status, message = self.kernel_status(ref)
            if status in TERMINAL or _now() > deadline:
                return status, message
            time.sleep(0.05)

    def quota_used_s(self, user: str, kind: str, now: float | None = None) -> float:
        now = _now() if now is None else now
        start = _week_start(now)
        used = 0.0
        with self.lock:
            for kernel in self.state["kernels"].values():
                if kernel["owner"] != user:
                    continue
                for v in kernel["versions"]:
                    if v.get("accelerator") != kind or v.get("started") is None:
                        continue
                    end = v.get("ended") or now
                    used += max(0.0, min(end, now) - max(v["started"], start))
        return used

    # ----- lookups -----

    def _kernel(self, ref: str) -> dict:
        owner, slug = _split_ref(ref, "kernel")
        kernel = self.state["kernels"].get(f"{owner}/{slug}")
        if kernel is None:
            raise ApiError(404, f"Kernel '{owner}/{slug}' not found")
        return kernel

    def _dataset(self, ref: str) -> dict:
        owner, slug = _split_ref(ref, "dataset")
        ds = self.state["datasets"].get(f"{owner}/{slug}")
        if ds is None or ds.get("deleted"):
            raise ApiError(404, f"Dataset '{owner}/{slug}' not found")
        return ds

    def _dataset_version(self, ds: dict, number: int | None) -> dict:
        live = [v for v in ds["versions"] if not v.get("deleted")]
        if number:
            for v in live:
                if v["number"] == number:
                    return v
            raise ApiError(404, f"Dataset '{ds['ref']}' has no version {number}")
        ready = [v for v in live if v["ready_at"] <= _now()]
        if not ready:
            raise ApiError(404, f"Dataset '{ds['ref']}' has no ready version yet")
        return ready[-1]

    def _dataset_dir(self, ds: dict, number: int) -> Path:
        return self.root / "datasets" / ds["owner"] / ds["slug"] / str(number)

    def _kernel_dir(self, kernel: dict, number: int) -> Path:
        return self.root / "kernels" / kernel["owner"] / kernel["slug"] / str(number)

    def _check_access(self, user: str, owner: str, private: bool, what: str) -> None:
        if private and owner != user:
            raise ApiError(403, f"Permission denied: {what} is private to {owner!r}")

    # ----- blobs (uploads) -----

    def start_blob_upload(self, user: str, req: ApiStartBlobUploadRequest) -> ApiStartBlobUploadResponse:
        name = os.path.basename(req.name)
        if not name:
            raise ApiError(400, "StartBlobUpload needs a file name")
        token = uuid.uuid4().hex
        with self.lock:
            self.state["uploads"][token] = {
                "user": user,
                "name": name,
                "size": req.content_length,
                "received": 0,
                "complete": False,
                "created": _now(),
            }
            (self.root / "blobs" / token).touch()
            self._save()
        return message(ApiStartBlobUploadResponse, token=token, create_url=f"http://localhost/_upload/{token}")

    def _blob_path(self, token: str) -> Path:
        return self.root / "blobs" / token

    # ----- datasets -----

    def _version_files_from_tokens(self, user: str, files: list[ApiDatasetNewFile]
                                   ) -> list[tuple[str, Path, str | None, str]]:
        if not files:
            raise ApiError(400, "A dataset version needs at least one file; none were uploaded")
        out, names = [], set()
        for f in files:
            token = f.token
            up = self.state["uploads"].get(token)
            if up is None or up["user"] != user:
                raise ApiError(400, f"Unknown upload token {token!r}")
            if not up["complete"]:
                raise ApiError(400, f"Upload of {up['name']!r} is incomplete ({up['received']}/{up['size']} bytes)")
            if up["name"] in names:
                raise ApiError(400, f"Two files named {up['name']!r} in one version")
            names.add(up["name"])
            source = self._blob_path(token)
            if not source.exists():  # already used by a version (a client retry): link from that copy
                source = Path(up.get("used_by") or source)
                if not source.exists():
                    raise ApiError(400, f"Upload of {up['name']!r} is no longer available; upload it again")
            out.append((up["name"], source, f.description or None, token))
        return out

    def _write_version(self, ds: dict, files: list[tuple[str, Path, str | None, str]], notes: str | None) -> dict:
        """Materialize a new version next to the old ones; existing versions are never touched."""
        numbers = [v["number"] for v in ds["versions"]]
        base = self.root / "datasets" / ds["owner"] / ds["slug"]
        base.mkdir(parents=True, exist_ok=True)
        existing = [int(p.name) for p in base.iterdir() if p.name.isdigit()]
        number = max(numbers + existing + [0]) + 1
        tmp = base / f".tmp-{number}-{uuid.uuid4().hex}"
        tmp.mkdir()
        entries = []
        for name, blob, description, _token in files:
            _link_or_copy(blob, tmp / name)
            os.chmod(tmp / name, 0o444)
            entries.append({"name": name, "size": (tmp / name).stat().st_size, "description": description})
        os.rename(tmp, base / str(number))
        for name, _blob, _description, token in files:  # the version holds the bytes now; drop the blob
            self.state["uploads"][token]["used_by"] = str(base / str(number) / name)
            self._blob_path(token).unlink(missing_ok=True)
        now = _now()
        version = {
            "number": number,
            "created": now,
            "notes": notes,
            "files": entries,
            "ready_at": now + self.dataset_ready_delay_s,
            "creator": ds["owner"],
        }
        ds["versions"].append(version)
        ds["updated"] = now
        return version

    def create_dataset(self, user: str, req: ApiCreateDatasetRequest) -> ApiCreateDatasetResponse:
        owner, slug = req.owner_slug or user, req.slug
        if not SLUG_RE.match(slug or "-"):
            raise ApiError(400, f"Invalid dataset slug {slug!r}")
        if owner != user:
            raise ApiError(403, f"Permission denied: cannot create a dataset owned by {owner!r} as {user!r}")
        ref = f"{owner}/{slug}"
        with self.lock:
            existing = self.state["datasets"].get(ref)
            if existing is not None and not existing.get("deleted"):
                return message(ApiCreateDatasetResponse, status="error",
                               error=f"The dataset '{ref}' already exists; push a new version")
            files = self._version_files_from_tokens(user, req.files)
            ds = {
                "id": self._next_id(),
                "ref": ref,
                "owner": owner,
                "slug": slug,
                "title": req.title or slug,
                "subtitle": req.subtitle or None,
                "description": req.description or None,
                "license": req.license_name or "unknown",
                "is_private": req.is_private,
                "created": _now(),
                "versions": existing["versions"] if existing else [],
            }
            self._write_version(ds, files, "Initial release")
            self.state["datasets"][ref] = ds
            self._save()
        return message(ApiCreateDatasetResponse, ref=ref, url=f"http://localhost/datasets/{ref}", status="Ok")

    def create_dataset_version(self, user: str, ref: str | None, body: ApiCreateDatasetVersionRequestBody | None,
                               dataset_id: int | None = None) -> ApiCreateDatasetResponse:
        """A new version of the dataset `ref` (owner/slug), or of the one with `dataset_id`."""
        with self.lock:
            if dataset_id is not None:
                matches = [d for d in self.state["datasets"].values() if d["id"] == dataset_id]
                if not matches or matches[0].get("deleted"):
                    raise ApiError(404, f"Dataset with id {dataset_id} not found")
                ds = matches[0]
            else:
                ds = self._dataset(ref)
            if ds["owner"] != user:
                raise ApiError(403, f"Permission denied: dataset '{ds['ref']}' belongs to {ds['owner']!r}")
            body = body or ApiCreateDatasetVersionRequestBody()
            files = self._version_files_from_tokens(user, body.files)
            version = self._write_version(ds, files, body.version_notes or None)
            if body.subtitle:
                ds["subtitle"] = body.subtitle
            if body.description:
                ds["description"] = body.description
            if body.delete_old_versions:
                for v in ds["versions"]:
                    if v["number"] != version["number"] and not v.get("deleted"):
                        v["deleted"] = True
                        shutil.rmtree(self._dataset_dir(ds, v["number"]), ignore_errors=True)
            self._save()
        return message(ApiCreateDatasetResponse, ref=ds["ref"], url=f"http://localhost/datasets/{ds['ref']}",
                       status="Ok")

    def _dataset_message(self, ds: dict) -> ApiDataset:
        live = [v for v in ds["versions"] if not v.get("deleted")]
        current = live[-1] if live else None
        return message(
            ApiDataset,
            id=ds["id"],
            ref=ds["ref"],
            title=ds["title"],
            subtitle=ds.get("subtitle"),
            description=ds.get("description"),
            owner_name=ds["owner"],
            owner_ref=ds["owner"],
            creator_name=ds["owner"],
            is_private=ds["is_private"],
            license_name=ds["license"],
            url=f"http://localhost/datasets/{ds['ref']}",
            last_updated=_utc(ds.get("updated", ds["created"])),
            total_bytes=sum(f["size"] for f in current["files"]) if current else 0,
            current_version_number=current["number"] if current else None,
            versions=[
                message(
                    ApiDatasetVersion,
                    version_number=v["number"],
                    creation_date=_utc(v["created"]),
                    version_notes=v.get("notes"),
                    creator_name=v.get("creator"),
                    # A free-form string in kagglesdk; what Kaggle puts there is not known.
                    status="ready" if v["ready_at"] <= _now() else "pending",
                )
                for v in live
            ],
        )

    def _dataset_visible(self, user: str, ref: str) -> dict:
        ds = self._dataset(ref)
        self._check_access(user, ds["owner"], ds["is_private"], f"dataset '{ds['ref']}'")
        return ds

    # ----- kernels -----

    def save_kernel(self, user: str, req: ApiSaveKernelRequest) -> ApiSaveKernelResponse:
        with self.lock:
            kernel = None
            if req.id:
                kernel = next((k for k in self.state["kernels"].values() if k["id"] == req.id), None)
                if kernel is None:
                    raise ApiError(404, f"Kernel with id {req.id} not found")
                ref = kernel["ref"]
            else:
                owner, slug = _split_ref(req.slug, "kernel")
                if not SLUG_RE.match(slug):
                    raise ApiError(400, f"Invalid kernel slug {slug!r}")
                ref = f"{owner}/{slug}"
                kernel = self.state["kernels"].get(ref)
            owner = ref.split("/")[0]
            if owner != user:
                raise ApiError(403, f"Permission denied: cannot push kernel '{ref}' as {user!r}")
            language = req.language or (kernel or {}).get("language") or "python"
            if language != "python":
                raise ApiError(400, f"The local Kaggle runs python kernels only, not {language!r}")
            kernel_type = req.kernel_type or (kernel or {}).get("kernel_type") or "script"
            if kernel_type not in ("script", "notebook"):
                raise ApiError(400, f"Unknown kernel_type {kernel_type!r}; use script or notebook")
            if "text" not in req:
                raise ApiError(400, "The kernel push has no source text")
            if kernel_type == "notebook":
                try:
                    notebook_to_script(req.text)
                except (ValueError, AttributeError) as err:
                    raise ApiError(400, f"The notebook is not valid .ipynb JSON: {err}") from None
            shape = req.machine_shape or None
            if shape is not None and shape not in MACHINE_SHAPES:
                raise ApiError(
                    400, f"Unknown machine_shape {shape!r}; valid: {', '.join(sorted(MACHINE_SHAPES))}"
                )
            tpu, gpu = req.enable_tpu, req.enable_gpu
            if shape is None and tpu and gpu:
                raise ApiError(400, "enable_tpu and enable_gpu are both true; choose one accelerator")
            if shape is None:
                shape = DEFAULT_TPU_SHAPE if tpu else DEFAULT_GPU_SHAPE if gpu else None
            accel = MACHINE_SHAPES.get(shape) if shape else None
            if accel is not None:
                used = self.quota_used_s(user, accel)
                if used >= self.quota_s[accel]:
                    return message(
                        ApiSaveKernelResponse,
                        error=f"Your weekly {accel.upper()} quota of {self.quota_s[accel] / 3600:g} hours is "
                        f"used up ({used / 3600:.2f} h); it resets at {_iso(_week_start(_now()) + 7 * 86400)}",
                    )
            datasets = list(req.dataset_data_sources)
            kernels_src = list(req.kernel_data_sources)
            competitions = list(req.competition_data_sources)
            invalid_ds = [d for d in datasets if not self._source_exists(user, "dataset", d)]
            invalid_k = [k for k in kernels_src if not self._source_exists(user, "kernel", k)]
            limit = self.session_limit_s
            if req.session_timeout_seconds:
                limit = min(limit, float(req.session_timeout_seconds))
            now = _now()
            if kernel is None:
                kernel = {
                    "id": self._next_id(),
                    "ref": ref,
                    "owner": owner,
                    "slug": ref.split("/")[1],
                    "created": now,
                    "versions": [],
                }
                self.state["kernels"][ref] = kernel
            kernel["title"] = req.new_title or kernel.get("title") or kernel["slug"]
            kernel["language"] = language
            kernel["kernel_type"] = kernel_type
            if "is_private" in req:
                kernel["is_private"] = req.is_private
            kernel.setdefault("is_private", True)
            number = len(kernel["versions"]) + 1
            vdir = self._kernel_dir(kernel, number)
            if vdir.exists():  # left over from a crash between mkdir and save; never reuse it silently
                shutil.rmtree(vdir)
            vdir.mkdir(parents=True)
            (vdir / "source.txt").write_text(req.text, encoding="utf-8")
            kernel["versions"].append(
                {
                    "number": number,
                    "session_id": self._next_id(),
                    "created": now,
                    "queued_at": now,
                    "status": "QUEUED",
                    "failure_message": None,
                    "machine_shape": shape,
                    "accelerator": accel,
                    "enable_internet": req.enable_internet if "enable_internet" in req else True,
                    "dataset_sources": [d for d in datasets if d not in invalid_ds],
                    "kernel_sources": [k for k in kernels_src if k not in invalid_k],
                    "competition_sources": competitions,
                    "limit_s": limit,
                    "started": None,
                    "ended": None,
                    "outputs_saved": False,
                }
            )
            self._save()
        return message(
            ApiSaveKernelResponse,
            ref=f"/code/{ref}",
            url=f"http://localhost/code/{ref}",
            version_number=number,
            kernel_id=kernel["id"],
            invalid_dataset_sources=invalid_ds,
            invalid_kernel_sources=invalid_k,
            invalid_competition_sources=competitions,  # no competitions exist locally
        )

    def _source_exists(self, user: str, kind: str, ref: str) -> bool:
        try:
            if kind == "dataset":
                self._dataset_visible(user, ref)
            else:
                k = self._kernel(ref)
                self._check_access(user, k["owner"], k.get("is_private", True), f"kernel '{ref}'")
        except ApiError:
            return False
        return True

    def _kernel_visible(self, user: str, ref: str) -> dict:
        kernel = self._kernel(ref)
        self._check_access(user, kernel["owner"], kernel.get("is_private", True), f"kernel '{kernel['ref']}'")
        return kernel

    def _output_version(self, kernel: dict) -> dict | None:
        """The version whose output `kernels output` serves: the newest finished one."""
        done = [v for v in kernel["versions"] if v["status"] in TERMINAL]
        return done[-1] if done else None

    def _output_files(self, kernel: dict, version: dict) -> list[tuple[str, Path]]:
        if not version.get("outputs_saved"):
            return []
        working = self._kernel_dir(kernel, version["number"]) / "kaggle" / "working"
        out = []
        for dirpath, dirs, files in os.walk(working):
            dirs.sort()
            for name in sorted(files):
                path = Path(dirpath) / name
                out.append((path.relative_to(working).as_posix(), path))
        return out

    def _log_events(self, kernel: dict, number: int) -> list[dict]:
        path = self._kernel_dir(kernel, number) / "log.jsonl"
        events = []
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        events.append(json.loads(line))
        except FileNotFoundError:
            pass
        return events

    def _kernel_message(self, kernel: dict) -> ApiKernelMetadata:
        last = kernel["versions"][-1] if kernel["versions"] else {}
        shape = last.get("machine_shape")
        return message(
            ApiKernelMetadata,
            id=kernel["id"],
            ref=kernel["ref"],
            title=kernel.get("title", kernel["slug"]),
            author=kernel["owner"],
            slug=kernel["slug"],
            last_run_time=_utc(last.get("started") or last.get("created")),
            language=kernel.get("language"),
            kernel_type=kernel.get("kernel_type"),
            is_private=kernel.get("is_private", True),
            enable_gpu=MACHINE_SHAPES.get(shape) == "gpu",
            enable_tpu=MACHINE_SHAPES.get(shape) == "tpu",
            enable_internet=last.get("enable_internet", True),
            dataset_data_sources=list(last.get("dataset_sources", [])),
            kernel_data_sources=list(last.get("kernel_sources", [])),
            competition_data_sources=list(last.get("competition_sources", [])),
            current_version_number=last.get("number"),
            machine_shape=shape,
        )

    # ----- the session runner -----

    def _scheduler(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self._schedule_once()
            except Exception as err:  # keep scheduling; report
                print(f"local-kaggle: scheduler error: {err!r}", file=sys.stderr)

    def _schedule_once(self) -> None:
        with self.lock:
            running = {"tpu": 0, "gpu": 0, "cpu": 0}
            for kernel in self.state["kernels"].values():
                for v in kernel["versions"]:
                    if v["status"] == "RUNNING":
                        running[v.get("accelerator") or "cpu"] += 1
            queued = sorted(
                ((v["queued_at"], kernel, v) for kernel in self.state["kernels"].values()
                 for v in kernel["versions"] if v["status"] == "QUEUED"),
                key=lambda item: item[0],
            )
            now = _now()
            for queued_at, kernel, v in queued:
                kind = v.get("accelerator") or "cpu"
                if queued_at + self.queue_delay_s > now or running[kind] >= self.concurrency[kind]:
                    continue
                running[kind] += 1
                v["status"] = "RUNNING"
                v["started"] = now
                session = Session(kernel["ref"], v["number"], v["limit_s"], self.faults.take_kill(kernel["ref"]))
                self.sessions[(kernel["ref"], v["number"])] = session
                self._save()
                t = threading.Thread(target=self._run_session, args=(kernel, v, session), daemon=True)
                t.start()

    def _finish(self, kernel: dict, v: dict, session: Session, status: str, message: str | None,
                keep_outputs: bool) -> None:
        vdir = self._kernel_dir(kernel, v["number"])
        with self.lock:
            v["status"] = status
            v["failure_message"] = message
            v["ended"] = _now()
            v["outputs_saved"] = keep_outputs
            self.sessions.pop((kernel["ref"], v["number"]), None)
            self._save()
        if not keep_outputs:
            shutil.rmtree(vdir / "kaggle" / "working", ignore_errors=True)
        for sub in ("temp", "input"):
            _make_writable(vdir / "kaggle" / sub)
            shutil.rmtree(vdir / "kaggle" / sub, ignore_errors=True)
        (vdir / "secrets.json").unlink(missing_ok=True)
        session.done.set()

    def _materialize_inputs(self, kernel: dict, v: dict, input_dir: Path) -> None:
        input_dir.mkdir(parents=True, exist_ok=True)
        for ref in v["dataset_sources"]:
            with self.lock:
                ds = self._dataset(ref)
                version = self._dataset_version(ds, None)
                src = self._dataset_dir(ds, version["number"])
                names = [f["name"] for f in version["files"]]
            dst = input_dir / ds["slug"]
            dst.mkdir(exist_ok=True)
            for name in names:
                _link_or_copy(src / name, dst / name)
        for ref in v["kernel_sources"]:
            with self.lock:
                src_kernel = self._kernel(ref)
                done = [x for x in src_kernel["versions"] if x["status"] == "COMPLETE" and x.get("outputs_saved")]
                files = self._output_files(src_kernel, done[-1]) if done else []
            dst = input_dir / src_kernel["slug"]
            dst.mkdir(exist_ok=True)
            for rel, path in files:
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(path, dst / rel)
        _make_read_only(input_dir)

    def _session_env(self, kernel: dict, v: dict, kroot: Path, secrets_file: Path) -> dict[str, str]:
        env = {
            k: val for k, val in os.environ.items()
            if not k.startswith(("KAGGLE_", "LOCAL_KAGGLE_")) and k.lower() not in PROXY_VARS
        }
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "LOCAL_KAGGLE_ROOT": str(kroot),
                "LOCAL_KAGGLE_SECRETS_FILE": str(secrets_file),
                "LOCAL_KAGGLE_ACCELERATOR": v.get("machine_shape") or "",
                "LOCAL_KAGGLE_KERNEL": kernel["ref"],
                "LOCAL_KAGGLE_VERSION": str(v["number"]),
                "TMPDIR": str(kroot / "temp"),
                # Every outbound request goes to this server: the Kaggle API is served, the internet is not.
                "HTTP_PROXY": self.proxy_url,
                "http_proxy": self.proxy_url,
                "HTTPS_PROXY": self.proxy_url,
                "https_proxy": self.proxy_url,
                "NO_PROXY": "",
                "no_proxy": "",
            }
        )
        if v.get("enable_internet"):
            env["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
        return env

    def _run_session(self, kernel: dict, v: dict, session: Session) -> None:
        ref, vdir = kernel["ref"], self._kernel_dir(kernel, v["number"])
        try:
            fault = self.faults.take_session_error(ref)
            if fault is not None:
                self._finish(kernel, v, session, "ERROR", fault["message"], keep_outputs=False)
                return
            kroot = vdir / "kaggle"
            for sub in ("working", "temp"):
                (kroot / sub).mkdir(parents=True, exist_ok=True)
            self._materialize_inputs(kernel, v, kroot / "input")
            text = (vdir / "source.txt").read_text(encoding="utf-8")
            if kernel.get("kernel_type") == "notebook":
                text = notebook_to_script(text)
            src = vdir / "src"
            src.mkdir(exist_ok=True)
            script = src / f"{kernel['slug']}.py"
            script.write_text(text, encoding="utf-8")
            secrets_file = vdir / "secrets.json"
            _atomic_write_json(secrets_file, self._secrets_of(kernel["owner"]), mode=0o600)
            env = self._session_env(kernel, v, kroot, secrets_file)
            log_path = vdir / "log.jsonl"
            session.started = _now()
            with open(log_path, "a", encoding="utf-8") as log:
                session.proc = subprocess.Popen(
                    [self.python, str(script)],
                    cwd=kroot / "working",
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
                if session.kill_reason is not None:  # stopped before the process existed
                    session.kill(session.kill_reason, session.kill_status)
                readers = [
                    threading.Thread(target=self._pump, args=(session, stream, name, log), daemon=True)
                    for stream, name in ((session.proc.stdout, "stdout"), (session.proc.stderr, "stderr"))
                ]
                for r in readers:
                    r.start()
                self._watch(kernel, v, session, kroot / "working")
                for r in readers:
                    r.join(10)
            rc = session.proc.returncode
            if session.kill_reason is not None:
                self._finish(kernel, v, session, session.kill_status, session.kill_reason, keep_outputs=False)
            elif rc == 0:
                self._finish(kernel, v, session, "COMPLETE", None, keep_outputs=True)
            else:
                self._finish(kernel, v, session, "ERROR", f"Kernel process exited with code {rc}",
                             keep_outputs=True)
        except Exception as err:
            if session.proc is not None and session.proc.poll() is None:
                session.kill("internal error")
            self._finish(kernel, v, session, "ERROR", f"The local Kaggle failed to run the session: {err!r}",
                         keep_outputs=False)

    def _pump(self, session: Session, stream, name: str, log) -> None:
        pattern = session.kill_fault.get("on_log") if session.kill_fault else None
        for raw in iter(stream.readline, b""):
            data = raw.decode("utf-8", errors="replace")
            event = {"stream_name": name, "time": round(_now() - session.started, 3), "data": data}
            with session.log_lock:
                log.write(json.dumps(event) + "\n")
                log.flush()
            if pattern and re.search(pattern, data):
                session.kill(session.kill_fault["message"])
        stream.close()

    def _watch(self, kernel: dict, v: dict, session: Session, working: Path) -> None:
        proc = session.proc
        accel = v.get("accelerator")
        next_size_check = 0.0
        while proc.poll() is None:
            now = _now()
            elapsed = now - session.started
            if elapsed >= session.limit_s:
                session.kill(
                    f"Session exceeded its time limit of {session.limit_s:g} seconds and was killed; "
                    "its /kaggle/working output was not saved"
                )
            fault = session.kill_fault
            if fault and fault.get("after_s") is not None and elapsed >= float(fault["after_s"]):
                session.kill(fault["message"])
            if accel is not None and self.quota_used_s(kernel["owner"], accel, now) >= self.quota_s[accel]:
                session.kill(
                    f"Weekly {accel.upper()} quota of {self.quota_s[accel] / 3600:g} hours used up; "
                    "the session was stopped"
                )
            if now >= next_size_check:
                size = _dir_size(working)
                if size > self.working_cap_bytes:
                    session.kill(
                        f"/kaggle/working grew to {size} bytes, over its {self.working_cap_bytes}-byte limit; "
                        "the session was stopped"
                    )
                next_size_check = now + 0.5
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        # The process group may have children left; a session ends with all of them.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    # ----- the API -----

    def api(self, user: str, service: str, method: str, body) -> dict:
        """One API call: `body` (the request JSON) is read as the route's kagglesdk request type, and the reply is
        an instance of the route's kagglesdk reply type, returned as its JSON (`to_wire`)."""
        key = f"{service}/{method}"
        fn, types = API_ROUTES.get(key), SDK_ROUTES.get(key)
        if fn is None or types is None:
            raise ApiError(404, f"The local Kaggle does not implement {key}")
        request_type, reply_type = types
        if not isinstance(body, dict):
            raise ApiError(400, f"The request body is not a JSON object ({request_type.__name__})")
        try:
            req = request_type.from_dict(body)
        except Exception as err:  # an enum value the type does not have, say
            raise ApiError(400, f"The request is not a valid {request_type.__name__}: {err!r}") from None
        reply = fn(self, user, req)
        if not isinstance(reply, reply_type):
            raise TypeError(f"{key} replied with {type(reply).__name__}, not {reply_type.__name__}")
        return to_wire(reply)


def _paginate(items: list, req: KaggleObject, default_size: int = 20) -> tuple[list, str]:
    size = getattr(req, "page_size", 0) or default_size
    token = getattr(req, "page_token", "")
    if token:
        try:
            start = int(token)
        except ValueError:
            raise ApiError(400, f"Invalid page token {token!r}") from None
    elif getattr(req, "page", 0):
        start = (req.page - 1) * size
    else:
        start = 0
    page = items[start : start + size]
    nxt = str(start + size) if start + size < len(items) else ""
    return page, nxt


def _api_list_kernels(app: LocalKaggle, user, req):
    with app.lock:
        kernels = list(app.state["kernels"].values())
        if req.group == KernelsListViewType.PROFILE:
            kernels = [k for k in kernels if k["owner"] == user]
        else:
            kernels = [k for k in kernels if not k.get("is_private", True) or k["owner"] == user]
        if req.user:
            kernels = [k for k in kernels if k["owner"] == req.user]
        if req.search:
            s = req.search.lower()
            kernels = [k for k in kernels if s in k["ref"].lower() or s in k.get("title", "").lower()]
        if req.dataset:
            kernels = [k for k in kernels if k["versions"] and req.dataset in k["versions"][-1]["dataset_sources"]]
        kernels.sort(key=lambda k: -(k["versions"][-1]["created"] if k["versions"] else k["created"]))
        page, nxt = _paginate(kernels, req)
        return message(ApiListKernelsResponse, kernels=[app._kernel_message(k) for k in page], next_page_token=nxt)


def _api_get_kernel(app: LocalKaggle, user, req):
    with app.lock:
        kernel = app._kernel_visible(user, f"{req.user_name}/{req.kernel_slug}")
        last = kernel["versions"][-1]
        source = (app._kernel_dir(kernel, last["number"]) / "source.txt").read_text(encoding="utf-8")
        blob = message(ApiKernelBlob, source=source, language=kernel.get("language"),
                       kernel_type=kernel.get("kernel_type"), slug=kernel["slug"])
        return message(ApiGetKernelResponse, metadata=app._kernel_message(kernel), blob=blob)


def _api_save_kernel(app: LocalKaggle, user, req):
    return app.save_kernel(user, req)


def _api_kernel_status(app: LocalKaggle, user, req):
    with app.lock:
        kernel = app._kernel_visible(user, f"{req.user_name}/{req.kernel_slug}")
        v = kernel["versions"][-1]
        return message(ApiGetKernelSessionStatusResponse, status=KernelWorkerStatus[v["status"]],
                       failure_message=v.get("failure_message") or None)


def _api_list_output(app: LocalKaggle, user, req):
    with app.lock:
        kernel = app._kernel_visible(user, f"{req.user_name}/{req.kernel_slug}")
        version = app._output_version(kernel)
        if version is None:
            return ApiListKernelSessionOutputResponse()
        files = app._output_files(kernel, version)
        page, nxt = _paginate(files, req)
        base = f"http://localhost/_blobs/kernel-output/{kernel['ref']}/{version['number']}/"
        out = message(
            ApiListKernelSessionOutputResponse,
            files=[message(ApiKernelSessionOutputFile, url=base + urllib.parse.quote(rel), file_name=rel)
                   for rel, _ in page],
            next_page_token=nxt or None,
        )
        if not req.page_token:
            out.log = json.dumps(app._log_events(kernel, version["number"]))
        return out


def _api_cancel(app: LocalKaggle, user, req):
    """CancelKernelSession names the session (one version of a kernel) by its kernelSessionId only."""
    with app.lock:
        found = [(k, v) for k in app.state["kernels"].values() for v in k["versions"]
                 if v.get("session_id") == req.kernel_session_id]
        if not found:
            raise ApiError(404, f"Kernel session {req.kernel_session_id} not found")
        kernel, v = found[0]
        if kernel["owner"] != user:
            raise ApiError(403, f"Permission denied: kernel '{kernel['ref']}' belongs to {kernel['owner']!r}")
        if v["status"] in TERMINAL:
            return message(ApiCancelKernelSessionResponse,
                           error_message=f"Kernel session {req.kernel_session_id} has already ended ({v['status']})")
        session = app.sessions.get((kernel["ref"], v["number"]))
        if v["status"] == "QUEUED":
            v["status"] = "CANCEL_ACKNOWLEDGED"
            v["failure_message"] = "Cancelled by the user"
            v["ended"] = _now()
            app._save()
    if session is not None:
        session.kill("Cancelled by the user", status="CANCEL_ACKNOWLEDGED")
    return ApiCancelKernelSessionResponse()


def _api_quota(app: LocalKaggle, user, req):
    now = _now()
    quotas = {}
    for kind in ("gpu", "tpu"):
        with app.lock:
            ever_run = any(v.get("accelerator") == kind and v.get("started") is not None
                           for k in app.state["kernels"].values() if k["owner"] == user for v in k["versions"])
        quotas[kind] = message(
            ApiAcceleratorQuota,
            time_used=dt.timedelta(seconds=app.quota_used_s(user, kind, now)),
            total_time_allowed=dt.timedelta(seconds=app.quota_s[kind]),
            has_ever_run=ever_run,
        )
    return message(ApiGetAcceleratorQuotaStatisticsResponse, quota_refresh_time=_utc(_week_start(now) + 7 * 86400),
                   gpu_quota=quotas["gpu"], tpu_quota=quotas["tpu"])


def _api_start_blob(app: LocalKaggle, user, req):
    return app.start_blob_upload(user, req)


def _api_create_dataset(app: LocalKaggle, user, req):
    return app.create_dataset(user, req)


def _api_create_version(app: LocalKaggle, user, req):
    return app.create_dataset_version(user, f"{req.owner_slug}/{req.dataset_slug}", req.body)


def _api_create_version_by_id(app: LocalKaggle, user, req):
    return app.create_dataset_version(user, None, req.body, dataset_id=req.id)


def _ds_ref(req) -> str:
    return f"{req.owner_slug}/{req.dataset_slug}"


def _api_dataset_status(app: LocalKaggle, user, req):
    with app.lock:
        ds = app._dataset_visible(user, _ds_ref(req))
        live = [v for v in ds["versions"] if not v.get("deleted")]
        ready = bool(live) and live[-1]["ready_at"] <= _now()
        status = DatabundleVersionStatus.READY if ready else DatabundleVersionStatus.BLOBS_RECEIVED
        return message(ApiGetDatasetStatusResponse, status=status)


def _api_get_dataset(app: LocalKaggle, user, req):
    with app.lock:
        return app._dataset_message(app._dataset_visible(user, _ds_ref(req)))


def _api_dataset_metadata(app: LocalKaggle, user, req):
    with app.lock:
        ds = app._dataset_visible(user, _ds_ref(req))
        info = message(
            DatasetInfo,
            dataset_id=ds["id"],
            dataset_slug=ds["slug"],
            owner_user=ds["owner"],
            title=ds["title"],
            subtitle=ds.get("subtitle"),
            description=ds.get("description"),
            is_private=ds["is_private"],
            licenses=[message(SettingsLicense, name=ds["license"])],
        )
        return message(ApiGetDatasetMetadataResponse, info=info)


def _api_list_dataset_files(app: LocalKaggle, user, req):
    with app.lock:
        ds = app._dataset_visible(user, _ds_ref(req))
        version = app._dataset_version(ds, req.dataset_version_number)
        page, nxt = _paginate(version["files"], req)
        files = [
            message(
                ApiDatasetFile,
                ref=f"{ds['ref']}/{f['name']}",
                dataset_ref=ds["ref"],
                owner_ref=ds["owner"],
                name=f["name"],
                creation_date=_utc(version["created"]),
                description=f.get("description"),
                total_bytes=f["size"],
            )
            for f in page
        ]
        return message(ApiListDatasetFilesResponse, dataset_files=files, next_page_token=nxt or None)


def _api_list_datasets(app: LocalKaggle, user, req):
    with app.lock:
        items = [d for d in app.state["datasets"].values() if not d.get("deleted")]
        if req.group == DatasetSelectionGroup.DATASET_SELECTION_GROUP_MY:
            items = [d for d in items if d["owner"] == user]
        else:
            items = [d for d in items if not d["is_private"] or d["owner"] == user]
        if req.user:
            items = [d for d in items if d["owner"] == req.user]
        if req.search:
            s = req.search.lower()
            items = [d for d in items if s in d["ref"].lower() or s in d["title"].lower()]
        items.sort(key=lambda d: -d.get("updated", d["created"]))
        page, nxt = _paginate(items, req)
        return message(ApiListDatasetsResponse, datasets=[app._dataset_message(d) for d in page],
                       next_page_token=nxt)


def _api_download_dataset(app: LocalKaggle, user, req):
    """The reply type is HttpRedirect: a redirect to the file (or the version's zip), never a JSON object."""
    with app.lock:
        ds = app._dataset_visible(user, _ds_ref(req))
        version = app._dataset_version(ds, req.dataset_version_number)
        name = req.file_name
        base = f"http://localhost/_blobs/dataset/{ds['ref']}/{version['number']}/"
        if name:
            if name not in {f["name"] for f in version["files"]}:
                raise ApiError(404, f"Dataset '{ds['ref']}' version {version['number']} has no file {name!r}")
            location = base + urllib.parse.quote(name)
        else:
            location = base + urllib.parse.quote(f"{ds['slug']}.zip") + "?zip=1"
    raise ApiError(302, "redirect", headers={"Location": location})


def _api_delete_dataset(app: LocalKaggle, user, req):
    with app.lock:
        ds = app._dataset(_ds_ref(req))
        if ds["owner"] != user:
            raise ApiError(403, f"Permission denied: dataset '{ds['ref']}' belongs to {ds['owner']!r}")
        ds["deleted"] = True
        app._save()
    return ApiDeleteDatasetResponse()


def _api_delete_kernel(app: LocalKaggle, user, req):
    with app.lock:
        kernel = app._kernel(f"{req.user_name}/{req.kernel_slug}")
        if kernel["owner"] != user:
            raise ApiError(403, f"Permission denied: kernel '{kernel['ref']}' belongs to {kernel['owner']!r}")
        if any(v["status"] not in TERMINAL for v in kernel["versions"]):
            raise ApiError(400, f"Kernel '{kernel['ref']}' has a session queued or running")
        del app.state["kernels"][kernel["ref"]]
        app._save()
    shutil.rmtree(app.root / "kernels" / kernel["owner"] / kernel["slug"], ignore_errors=True)
    return ApiDeleteKernelResponse()


def _api_introspect_token(app: LocalKaggle, user, req):
    return message(IntrospectTokenResponse, active=True, username=user)


# Each route's request and reply types are kagglesdk's (SDK_ROUTES); `LocalKaggle.api` enforces them.
KS, DS = "kernels.KernelsApiService", "datasets.DatasetApiService"
API_ROUTES: dict[str, Callable] = {
    f"{KS}/ListKernels": _api_list_kernels,
    f"{KS}/GetKernel": _api_get_kernel,
    f"{KS}/SaveKernel": _api_save_kernel,
    f"{KS}/GetKernelSessionStatus": _api_kernel_status,
    f"{KS}/ListKernelSessionOutput": _api_list_output,
    f"{KS}/CancelKernelSession": _api_cancel,
    f"{KS}/DeleteKernel": _api_delete_kernel,
    f"{KS}/GetAcceleratorQuotaStatistics": _api_quota,
    "blobs.BlobApiService/StartBlobUpload": _api_start_blob,
    f"{DS}/CreateDataset": _api_create_dataset,
    f"{DS}/CreateDatasetVersion": _api_create_version,
    f"{DS}/CreateDatasetVersionById": _api_create_version_by_id,
    f"{DS}/GetDatasetStatus": _api_dataset_status,
    f"{DS}/GetDataset": _api_get_dataset,
    f"{DS}/GetDatasetMetadata": _api_dataset_metadata,
    f"{DS}/ListDatasetFiles": _api_list_dataset_files,
    f"{DS}/ListDatasets": _api_list_datasets,
    f"{DS}/DownloadDataset": _api_download_dataset,
    f"{DS}/DeleteDataset": _api_delete_dataset,
    "security.OAuthService/IntrospectToken": _api_introspect_token,
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "LocalKaggle/1.0"
    app: LocalKaggle

    def log_message(self, fmt, *args):
        if self.app.verbose:
            sys.stderr.write("local-kaggle: " + (fmt % args) + "\n")

    # -- plumbing --

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return b"".join(self._iter_chunked())
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _iter_chunked(self):
        while True:
            line = self.rfile.readline()
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return
            data = self.rfile.read(size)
            self.rfile.readline()
            yield data

    def _iter_body(self, chunk: int = 1 << 20):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            yield from self._iter_chunked()
            return
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            data = self.rfile.read(min(chunk, remaining))
            if not data:
                break
            remaining -= len(data)
            yield data

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json", headers: dict | None = None):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, obj, headers: dict | None = None):
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _send_error(self, err: ApiError):
        if err.status in (301, 302, 303, 307, 308):
            self._send(err.status, b"", ctype="text/plain", headers=err.headers)
            return
        self._send_json(err.status, {"code": err.status, "message": err.message}, headers=err.headers)

    # -- verbs --

    def do_POST(self):
        self._dispatch()

    def do_GET(self):
        self._dispatch()

    def do_HEAD(self):
        self._dispatch()

    def do_PUT(self):
        self._dispatch()

    def do_DELETE(self):
        self._dispatch()

    def do_CONNECT(self):
        self._send_json(502, {"code": 502, "message": (
            f"The local Kaggle has no internet: refused CONNECT {self.path}. Set KAGGLE_API_ENVIRONMENT=LOCALHOST "
            "before importing kaggle so the client calls http://localhost.")})
        self.close_connection = True

    def _dispatch(self):
        try:
            url = urllib.parse.urlsplit(self.path)
            host = (url.hostname or "").lower()
            if url.scheme and host not in LOCAL_HOSTS:
                raise ApiError(502, f"The local Kaggle has no internet: refused {self.command} {self.path}")
            path = url.path
            query = urllib.parse.parse_qs(url.query)
            self._route(path, query)
        except ApiError as err:
            self._drain()
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as err:
            self._drain()
            self._send_json(500, {"code": 500, "message": f"local Kaggle internal error: {err!r}"})
            if self.app.verbose:
                import traceback

                traceback.print_exc()

    def _drain(self):
        """Read an unread request body so the connection can be reused."""
        if not getattr(self, "_body_read", False):
            self._body_read = True
            try:
                for _ in self._iter_body():
                    pass
            except Exception:
                self.close_connection = True

    def _fault(self, names: set[str]):
        fault = self.app.faults.take_http(names)
        if fault is not None:
            headers = {}
            if fault.get("retry_after") is not None:
                headers["Retry-After"] = str(fault["retry_after"])
            raise ApiError(int(fault["status"]), fault.get("message") or f"Injected HTTP {fault['status']}", headers)

    def _route(self, path: str, query: dict):
        self._body_read = False
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        app = self.app
        if parts[:2] == ["api", "v1"] and self.command == "POST" and len(parts) == 4:
            service, method = parts[2], parts[3]
            body = self._read_body()
            self._body_read = True
            self._fault({method, f"{service}/{method}", "api"})
            user = app.authenticate(self.headers.get("Authorization"))
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                raise ApiError(400, "The request body is not JSON") from None
            self._send_json(200, app.api(user, service, method, req))
            return
        if parts[:5] == ["api", "v1", "kernels", "logs", "stream"] and len(parts) == 7:
            self._fault({"GetKernelSessionLogsStream", "logs", "api"})
            user = app.authenticate(self.headers.get("Authorization"))
            self._stream_logs(user, f"{parts[5]}/{parts[6]}")
            return
        if parts[0] == "_upload" and len(parts) == 2 and self.command == "PUT":
            self._fault({"upload", "blob"})
            self._upload(parts[1])
            return
        if parts[0] == "_blobs" and self.command in ("GET", "HEAD"):
            self._fault({"download", "blob"})
            self._serve_blob(parts[1:], query)
            return
        if parts[0] == "_admin":
            self._admin(parts[1:])
            return
        raise ApiError(404, f"The local Kaggle has nothing at {self.command} {path}")

    # -- blob upload (a resumable PUT, as the client does against GCS) --

    def _upload(self, token: str):
        app = self.app
        with app.lock:
            up = app.state["uploads"].get(token)
            if up is None:
                raise ApiError(404, f"Unknown upload {token!r}")
            up = dict(up)
        if up.get("used_by"):
            self._drain()
            if re.match(r"bytes \*/\d+$", self.headers.get("Content-Range", "")):
                self._send(200, b"", ctype="text/plain")  # a status query: it is complete
                return
            raise ApiError(400, f"Upload {token!r} was already used by a dataset version")
        crange = self.headers.get("Content-Range", "")
        m = re.match(r"bytes \*/(\d+)$", crange)
        if m:  # status query of a resumable upload
            self._drain()
            if up["complete"]:
                self._send(200, b"", ctype="text/plain")
            else:
                headers = {"Range": f"bytes=0-{up['received'] - 1}"} if up["received"] else {}
                self._send(308, b"", ctype="text/plain", headers=headers)
            return
        start = 0
        m = re.match(r"bytes (\d+)-(\d+)/(\d+)$", crange)
        if m:
            start = int(m.group(1))
            if start > up["received"]:
                self._drain()
                raise ApiError(400, f"Upload resumes at byte {start} but only {up['received']} were received")
        path = app._blob_path(token)
        received = start
        self._body_read = True
        with open(path, "r+b") as f:
            f.seek(start)
            f.truncate()
            for data in self._iter_body():
                f.write(data)
                received += len(data)
            f.flush()
            os.fsync(f.fileno())
        complete = received == up["size"]
        with app.lock:
            rec = app.state["uploads"][token]
            rec["received"] = received
            rec["complete"] = complete
            app._save()
        if complete:
            self._send_json(200, {"token": token})
        elif received < up["size"]:
            self._send(308, b"", ctype="text/plain", headers={"Range": f"bytes=0-{received - 1}"} if received else {})
        else:
            raise ApiError(400, f"Upload is {received} bytes but {up['size']} were declared")

    # -- blob download (kernel outputs, dataset files and zips) --

    def _serve_blob(self, parts: list[str], query: dict):
        app = self.app
        self._drain()
        if len(parts) < 5:
            raise ApiError(404, "No such blob")
        kind, owner, slug, number, rel = parts[0], parts[1], parts[2], parts[3], "/".join(parts[4:])
        if not number.isdigit():
            raise ApiError(404, "No such blob")
        with app.lock:
            if kind == "kernel-output":
                kernel = app._kernel(f"{owner}/{slug}")
                version = next((v for v in kernel["versions"] if v["number"] == int(number)), None)
                if version is None or not version.get("outputs_saved"):
                    raise ApiError(404, "No such output")
                base = app._kernel_dir(kernel, int(number)) / "kaggle" / "working"
                path = base / rel
            elif kind == "dataset":
                ds = app._dataset(f"{owner}/{slug}")
                version = app._dataset_version(ds, int(number))
                ds, version = dict(ds), dict(version)
                base = app._dataset_dir(ds, int(number))
                path = base / rel
            else:
                raise ApiError(404, "No such blob")
        if kind == "dataset" and "zip" in query:
            path = self._dataset_zip(ds, version)  # outside the state lock: zipping a big dataset takes a while
            base = path.parent
        path = path.resolve()
        if base.resolve() not in path.parents or not path.is_file():
            raise ApiError(404, f"No such file {rel!r}")
        self._send_file(path)

    def _dataset_zip(self, ds: dict, version: dict) -> Path:
        app = self.app
        zpath = app.root / "zips" / ds["owner"] / ds["slug"] / f"{version['number']}.zip"
        with app.zip_lock:
            if zpath.exists():
                return zpath
            zpath.parent.mkdir(parents=True, exist_ok=True)
            tmp = zpath.with_name(f".{zpath.name}.{uuid.uuid4().hex}.tmp")
            src = app._dataset_dir(ds, version["number"])
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
                for f in version["files"]:
                    z.write(src / f["name"], f["name"])
            os.replace(tmp, zpath)
            return zpath

    def _send_file(self, path: Path):
        st = path.stat()
        size = st.st_size
        etag = f'"{st.st_ino:x}-{size:x}-{int(st.st_mtime_ns):x}"'
        start = 0
        status = 200
        rng = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        m = re.match(r"bytes=(\d+)-$", rng or "")
        if m and (if_range is None or if_range in (etag, _http_date(st.st_mtime))):
            start = int(m.group(1))
            if start >= size:
                raise ApiError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", _http_date(st.st_mtime))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(path, "rb") as f:
            f.seek(start)
            shutil.copyfileobj(f, self.wfile, 1 << 20)

    # -- live logs (`kaggle kernels logs --follow`) --

    def _stream_logs(self, user: str, ref: str):
        app = self.app
        self._drain()
        with app.lock:
            kernel = app._kernel_visible(user, ref)
            v = kernel["versions"][-1]
            number, running = v["number"], v["status"] not in TERMINAL
        if not running:
            body = json.dumps(app._log_events(kernel, number)).encode()
            self._send(200, body, ctype="application/octet-stream")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent = 0
        while True:
            with app.lock:
                finished = v["status"] in TERMINAL
            events = app._log_events(kernel, number)
            for event in events[sent:]:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            sent = len(events)
            self.wfile.flush()
            if finished:
                break
            time.sleep(0.2)
        self.wfile.write(b"data: END_OF_LOG\n\n")
        self.wfile.flush()

    # -- admin (tests and operators driving a server in another process) --

    def _admin(self, parts: list[str]):
        app = self.app
        body = self._read_body()
        self._body_read = True
        if not secrets.compare_digest(self.headers.get(ADMIN_HEADER, ""), app.admin_token):
            raise ApiError(403, f"admin calls need the {ADMIN_HEADER} header from <root>/admin_token")
        req = json.loads(body or b"{}")
        action = parts[0] if parts else ""
        if action == "fault":
            app.faults.add(req)
        elif action == "clear-faults":
            app.faults.clear()
        elif action == "kill":
            if not app.kill_session(req["kernel"], req.get("message") or "Killed by the local Kaggle operator"):
                raise ApiError(404, f"Kernel {req['kernel']!r} has no running session")
        elif action == "user":
            app.add_user(req["name"], req["key"])
        elif action == "secret":
            app.set_secret(req["user"], req["name"], req["value"])
        elif action == "quota":
            self._send_json(200, {k: app.quota_used_s(req["user"], k) for k in ("tpu", "gpu")})
            return
        else:
            raise ApiError(404, f"Unknown admin action {action!r}")
        self._send_json(200, {"ok": True})


def admin_call(root: str | os.PathLike, port: int, action: str, payload: dict | None = None) -> dict:
    """Call a running server's admin endpoint directly (no proxy), e.g. admin_call(root, port, "fault", {...})."""
    import http.client

    token = (Path(root) / "admin_token").read_text().strip()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", f"/_admin/{action}", body=json.dumps(payload or {}),
                     headers={ADMIN_HEADER: token, "Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"admin {action}: HTTP {resp.status}: {data.get('message')}")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the server")
    serve.add_argument("--root", required=True, help="state folder (datasets, kernels, blobs, users, secrets)")
    serve.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: pick one and print it)")
    serve.add_argument("--session-limit", type=float, default=DEFAULT_SESSION_LIMIT_S, help="seconds per session")
    serve.add_argument("--working-cap-gb", type=float, default=DEFAULT_WORKING_CAP_BYTES / 1e9)
    serve.add_argument("--quota-hours", type=float, default=DEFAULT_TPU_QUOTA_HOURS, help="weekly TPU hours")
    serve.add_argument("--gpu-quota-hours", type=float, default=DEFAULT_GPU_QUOTA_HOURS, help="weekly GPU hours")
    serve.add_argument("--queue-delay", type=float, default=0.3, help="seconds a pushed version stays queued")
    serve.add_argument("--dataset-ready-delay", type=float, default=0.0,
                       help="seconds before a new dataset version is ready")
    serve.add_argument("--user", action="append", default=[], metavar="NAME:KEY",
                       help="add a user (also read: KAGGLE_USERNAME/KAGGLE_KEY of this process)")
    serve.add_argument("--faults", help="a JSON file with a list of faults to inject")
    serve.add_argument("--verbose", action="store_true")
    for name, help_ in (("user-add", "add a user; the key is read from stdin"),
                        ("secret-set", "set a secret for a user; the value is read from stdin")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--root", required=True)
        p.add_argument("user")
        if name == "secret-set":
            p.add_argument("name")
    args = parser.parse_args(argv)

    if args.cmd in ("user-add", "secret-set"):
        value = sys.stdin.readline().rstrip("\n")
        if not value:
            parser.error("nothing read from stdin")
        app = LocalKaggle(args.root)
        if args.cmd == "user-add":
            app.add_user(args.user, value)
        else:
            app.set_secret(args.user, args.name, value)
        return 0

    users = {}
    for spec in args.user:
        name, sep, key = spec.partition(":")
        if not sep:
            parser.error(f"--user {spec!r}: expected NAME:KEY")
        users[name] = key
    if os.environ.get("KAGGLE_USERNAME") and os.environ.get("KAGGLE_KEY"):
        users.setdefault(os.environ["KAGGLE_USERNAME"], os.environ["KAGGLE_KEY"])
    faults = json.loads(Path(args.faults).read_text()) if args.faults else None
    app = LocalKaggle(
        args.root,
        port=args.port,
        session_limit_s=args.session_limit,
        working_cap_bytes=int(args.working_cap_gb * 1e9),
        tpu_quota_hours=args.quota_hours,
        gpu_quota_hours=args.gpu_quota_hours,
        queue_delay_s=args.queue_delay,
        dataset_ready_delay_s=args.dataset_ready_delay,
        users=users,
        faults=faults,
        verbose=args.verbose,
    )
    app.start()
    if not app.users():
        print("local-kaggle: warning: no users; add one with --user NAME:KEY or user-add", file=sys.stderr)
    print(f"local-kaggle: serving {app.root} on port {app.port}", flush=True)
    print(f"  export KAGGLE_API_ENVIRONMENT=LOCALHOST HTTP_PROXY={app.proxy_url} NO_PROXY=", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: app._stop.set())
    try:
        while not app._stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    app.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
