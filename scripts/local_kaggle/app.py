"""`LocalKaggle`: one local Kaggle server, composed of its parts.

It builds the state (`state`), the datasets and uploads (`datasets`), the kernels and their scheduler (`kernels`),
the API (`api`) and the HTTP server (`server`), handing each the parts it uses; it starts, stops and serves them,
gives the environment that points a client at it, and has the helpers tests and operators use (users, secrets,
faults, kills, quota, a kernel's status, the admin actions).
"""

from __future__ import annotations

import os
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from .api import ApiParts, call_api
from .datasets import Datasets, Uploads
from .kernels import Kernels
from .rules import (
    DEFAULT_GPU_QUOTA_HOURS,
    DEFAULT_SESSION_LIMIT_S,
    DEFAULT_TPU_QUOTA_HOURS,
    DEFAULT_WORKING_CAP_BYTES,
    TERMINAL,
    ApiError,
    Faults,
    Settings,
)
from .server import Backend, make_server, proxy_env
from .sessions import Runtime, Scheduler
from .state import LOST_SESSION, Accounts, Quota, Store


def _setting(name: str) -> property:
    """`LocalKaggle.<name>` reads and sets `settings.<name>`, so a test can tune a running server."""
    return property(lambda self: getattr(self.settings, name),
                    lambda self, value: setattr(self.settings, name, value))


class LocalKaggle:
    """The server, its on-disk state, and the session runner. Start it in threads with `start()`."""

    session_limit_s = _setting("session_limit_s")
    working_cap_bytes = _setting("working_cap_bytes")
    queue_delay_s = _setting("queue_delay_s")
    dataset_ready_delay_s = _setting("dataset_ready_delay_s")
    notebook_token_writes = _setting("notebook_token_writes")
    notebook_token_lifetime_s = _setting("notebook_token_lifetime_s")
    notebook_token_scope = _setting("notebook_token_scope")

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
        pythons: dict[str, str] | None = None,
        users: dict[str, str] | None = None,
        faults: list[dict] | None = None,
        verbose: bool = False,
    ):
        self.settings = Settings(session_limit_s=float(session_limit_s), working_cap_bytes=int(working_cap_bytes),
                                 queue_delay_s=queue_delay_s, dataset_ready_delay_s=dataset_ready_delay_s)
        self.settings.concurrency.update(concurrency or {})
        self.settings.pythons.update(pythons or {})
        self.host = host
        self.port = port
        self.verbose = verbose
        self.store = Store(root)
        self.root = self.store.root
        self.accounts = Accounts(self.root, self.store.lock, lambda: self.settings.notebook_token_writes,
                                 lambda: (self.settings.notebook_token_lifetime_s, self.settings.notebook_token_scope))
        self.faults = Faults()
        self.quota = Quota(self.store, tpu_quota_hours, gpu_quota_hours)
        self.uploads = Uploads(self.store, self.faults)
        self.datasets = Datasets(self.store, self.uploads, self.settings)
        self.kernels = Kernels(self.store, self.settings, self.quota, self.datasets)
        self.scheduler = Scheduler(Runtime(
            store=self.store, settings=self.settings, kernels=self.kernels, datasets=self.datasets, quota=self.quota,
            faults=self.faults, secrets_of=self.accounts.secrets_of, proxy_url=lambda: self.proxy_url,
            issue_token=self.accounts.issue_notebook_token, revoke_token=self.accounts.revoke_notebook_token))
        self.parts = ApiParts(store=self.store, kernels=self.kernels, scheduler=self.scheduler, datasets=self.datasets,
                              uploads=self.uploads, quota=self.quota, faults=self.faults, accounts=self.accounts)
        self._stop = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._threads: list[threading.Thread] = []
        for name, key in (users or {}).items():
            self.add_user(name, key)
        for fault in faults or []:
            self.faults.add(fault)
        self.store.recover()

    @property
    def state(self) -> dict:
        """The whole state (as in <root>/state.json); hold `store.lock` to read it while the server runs."""
        return self.store.state

    @property
    def quota_s(self) -> dict[str, float]:
        """Weekly quota in seconds per kind ("tpu", "gpu"); change an entry to change the quota."""
        return self.quota.allowed_s

    # ----- lifecycle -----

    def start(self) -> LocalKaggle:
        """Serve HTTP and run the scheduler, each in a thread; -> self."""
        self._httpd = make_server(self.host, self.port, self._backend())
        self.port = self._httpd.server_address[1]
        for name, target, args in (("http", self._httpd.serve_forever, ()),
                                   ("scheduler", self.scheduler.loop, (self._stop,))):
            t = threading.Thread(target=target, args=args, daemon=True, name=f"local-kaggle-{name}")
            t.start()
            self._threads.append(t)
        return self

    def _backend(self) -> Backend:
        """What the HTTP server serves from."""
        return Backend(
            verbose=self.verbose,
            admin_token=self.accounts.admin_token,
            authenticate=self.accounts.authenticate,
            authorize=self.accounts.authorize,
            take_http_fault=self.faults.take_http,
            call_api=self.api,
            receive_upload=self.uploads.receive,
            kernel_output_dir=self.kernels.output_dir,
            dataset_dir=self.datasets.version_dir,
            dataset_zip=self.datasets.zip_file,
            kernel_log=self.kernels.log_so_far,
            admin=self.admin,
        )

    def stop(self) -> None:
        """Stop serving; running sessions are killed and recorded as errors (as a lost Kaggle VM would be)."""
        self._stop.set()
        self.scheduler.stop_all(LOST_SESSION)
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        for t in self._threads:
            t.join(5)

    def __enter__(self) -> LocalKaggle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def serve_forever(self) -> None:
        """Serve (starting first unless started) until `stop_soon` or Ctrl-C, then stop."""
        if self._httpd is None:
            self.start()
        try:
            while not self._stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()

    def stop_soon(self) -> None:
        """Make `serve_forever` return (safe from a signal handler)."""
        self._stop.set()

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client_env(self, user: str | None = None, key: str | None = None) -> dict[str, str]:
        """Environment variables that point the real kaggle CLI / kagglesdk at this server."""
        env = {"KAGGLE_API_ENVIRONMENT": "LOCALHOST", **proxy_env(self.proxy_url)}
        if user is not None:
            env["KAGGLE_USERNAME"] = user
        if key is not None:
            env["KAGGLE_KEY"] = key
        return env

    # ----- users and notebooks' secrets -----

    def users(self) -> dict[str, str]:
        return self.accounts.users()

    def add_user(self, name: str, key: str) -> None:
        self.accounts.add_user(name, key)

    def add_api_token(self, name: str, token: str | None = None) -> str:
        """A new-style API token (KGAT_...) for user `name`, as Kaggle's settings page makes one; -> the token."""
        return self.accounts.add_api_token(name, token)

    def attach_secret(self, kernel_ref: str, name: str, value: str) -> None:
        """What a user does on a notebook's page (Add-ons > Secrets): only a notebook that exists has secrets."""
        with self.store.lock:
            self.kernels.get(kernel_ref)  # 404 for a notebook that was never saved
        self.accounts.attach_secret(kernel_ref, name, value)

    # ----- the API, fault injection and test helpers -----

    def api(self, user: str, service: str, method: str, body: Any) -> dict:
        """One API call as `user`, without HTTP: see `api.call_api`."""
        return call_api(self.parts, user, service, method, body)

    def inject(self, kind: str = "http", **fault: Any) -> None:
        """inject("http", match="SaveKernel", status=429, count=1, retry_after=0, message=...)
        inject("http", match="read", status=503, for_s=30.0)  (every read for 30 s)
        inject("http", match="CreateDatasetVersion", status=502, after=True)  (served, then answered 502)
        inject("session_error", kernel="u/k", message=...)
        inject("kill", kernel="u/k", after_s=1.0 | on_log=r"regex", message=...)
        inject("failed_upload", name="model.safetensors", count=1)"""
        self.faults.add({"kind": kind, **fault})

    def kill_session(self, ref: str, reason: str = "Killed by the local Kaggle operator") -> bool:
        return self.scheduler.kill(ref, reason)

    def session_id(self, ref: str, number: int | None = None) -> int:
        """The kernelSessionId of a version (default: the newest), which CancelKernelSession takes. No reply
        carries it (as on Kaggle: see docs/kaggle-api.md); it is in <root>/state.json too."""
        with self.store.lock:
            versions = self.kernels.get(ref)["versions"]
            v = versions[-1] if number is None else next(x for x in versions if x["number"] == number)
            return v["session_id"]

    def kernel_status(self, ref: str) -> tuple[str, str | None]:
        with self.store.lock:
            v = self.kernels.get(ref)["versions"][-1]
            return v["status"], v.get("failure_message")

    def wait_kernel(self, ref: str, timeout: float = 60.0) -> tuple[str, str | None]:
        deadline = time.time() + timeout
        while True:
            status, message = self.kernel_status(ref)
            if status in TERMINAL or time.time() > deadline:
                return status, message
            time.sleep(0.05)

    def quota_used_s(self, user: str, kind: str, now: float | None = None) -> float:
        return self.quota.used_s(user, kind, now)

    def admin(self, action: str, req: dict) -> dict:
        """What an operator (or a test driving a server in another process) can do: faults, kills, users, secrets."""
        if action == "fault":
            self.faults.add(req)
        elif action == "clear-faults":
            self.faults.clear()
        elif action == "kill":
            if not self.kill_session(req["kernel"], req.get("message") or "Killed by the local Kaggle operator"):
                raise ApiError(404, f"Kernel {req['kernel']!r} has no running session")
        elif action == "user":
            self.add_user(req["name"], req["key"])
        elif action == "api-token":
            return {"token": self.add_api_token(req["name"], req.get("token"))}
        elif action == "secret":
            self.attach_secret(req["kernel"], req["name"], req["value"])
        elif action == "quota":
            return {k: self.quota_used_s(req["user"], k) for k in ("tpu", "gpu")}
        else:
            raise ApiError(404, f"Unknown admin action {action!r}")
        return {"ok": True}
