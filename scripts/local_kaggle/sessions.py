"""Sessions: the kernel versions running. `Scheduler` starts queued versions in push order, as many at once as
each kind of machine allows, and cancels, kills and stops them. `Session`: one version running as
`python <script>` in its own process group, with Kaggle's folders under its version folder (inputs hard-linked and
read-only), its log captured, and its limits (time, quota, /kaggle/working size, injected kills) enforced until it
ends. `Runtime` is what the scheduler and its sessions use of the server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from shared.fsutil import link_or_copy
from shared.kaggle.disk import LOCAL_DISK_ENV, used_bytes

from .datasets import Datasets
from .kernels import Kernels, notebook_to_script
from .rules import (
    TERMINAL,
    ApiError,
    Faults,
    Settings,
    check_owner,
)
from .server import proxy_env
from .state import Quota, Store, atomic_write_json


@dataclass
class Runtime:
    """What the scheduler and its sessions use of the server: its parts, a notebook's secrets, and the URL that a
    session's HTTP goes to (known once the server listens)."""

    store: Store
    settings: Settings
    kernels: Kernels
    datasets: Datasets
    quota: Quota
    faults: Faults
    secrets_of: Callable[[str], dict[str, str]]
    proxy_url: Callable[[], str]
    # (a notebook's owner, the session's end: its start plus its time limit) -> a new access token for one session
    issue_token: Callable[[str, float], str]
    revoke_token: Callable[[str], None]


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


PROXY_VARS = {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the kernel and every process it started (a session ends with all of them)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# With internet on, a session reaches the package index (the only internet this workplace has), as a Kaggle session
# reaches PyPI; every other host still goes to this server, which refuses it.
PACKAGE_INDEX_HOSTS = "pypi.org,files.pythonhosted.org"


def session_env(kernel: dict, v: dict, kroot: Path, secrets_file: Path, proxy_url: str,
                token_file: Path | None = None) -> dict[str, str]:
    """The kernel's environment: this process's, minus any Kaggle credentials, proxies and (internet off) pip
    settings, plus what `shared.kaggle.env` reads to find the session's folders and secrets, and, as in a Kaggle
    notebook, the session's own access token (`token_file`) where kagglesdk's `get_access_token_from_env` finds it
    (KAGGLE_KERNEL_RUN_TYPE and KAGGLE_DATA_PROXY_URL set, KAGGLE_API_V1_TOKEN naming the file: kagglesdk 0.1.38
    kaggle_env.py L62-95)."""
    internet = bool(v.get("enable_internet"))
    env = {
        k: val for k, val in os.environ.items()
        if not k.startswith(("KAGGLE_", "LOCAL_KAGGLE_")) and k.lower() not in PROXY_VARS
        and (internet or not k.startswith("PIP_"))
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
            **proxy_env(proxy_url),
        }
    )
    if token_file is not None:
        env.update(KAGGLE_KERNEL_RUN_TYPE="Batch", KAGGLE_DATA_PROXY_URL=proxy_url,
                   KAGGLE_API_V1_TOKEN=str(token_file),
                   # What kagglehub's attach (KaggleJwtClient, kagglehub 1.0.3 clients.py L331-362) sends; the
                   # server refuses the attach itself, as batch sessions are reported to.
                   KAGGLE_USER_SECRETS_TOKEN="local-jwt", KAGGLE_DATA_PROXY_TOKEN="local-data-proxy")
    if internet:
        env["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
        # The internet a session reaches: the package index, and the Hugging Face Hub's stand-in where HF_ENDPOINT
        # names one (scripts/local_hub.py); without internet the Hub goes to this server, which refuses it.
        hub = urllib.parse.urlsplit(env.get("HF_ENDPOINT") or "").hostname
        env["NO_PROXY"] = env["no_proxy"] = PACKAGE_INDEX_HOSTS + (f",{hub}" if hub else "")
    else:  # nor this machine's pip configuration, local wheels or pip's cache: nothing to install from
        env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1")
    return env


def materialize_inputs(rt: Runtime, v: dict, input_dir: Path) -> None:
    """/kaggle/input/<slug>/: the newest ready version of each dataset source (the one before it while a stale_mount
    fault lasts) and the saved output of each kernel source's newest complete version, hard-linked and read-only."""
    input_dir.mkdir(parents=True, exist_ok=True)
    for ref in v["dataset_sources"]:
        with rt.store.lock:
            ds = rt.datasets.get(ref)
            version = rt.faults.mount_version(ds, rt.datasets.ready_versions(ds))
            src = rt.store.dataset_dir(ds, version["number"])
            names = [f["name"] for f in version["files"]]
        dst = input_dir / ds["slug"]
        dst.mkdir(exist_ok=True)
        for name in names:
            link_or_copy(src / name, dst / name)
    for ref in v["kernel_sources"]:
        with rt.store.lock:
            src_kernel = rt.kernels.get(ref)
            done = [x for x in src_kernel["versions"] if x["status"] == "COMPLETE" and x.get("outputs_saved")]
            files = rt.kernels.output_files(src_kernel, done[-1]) if done else []
        dst = input_dir / src_kernel["slug"]
        dst.mkdir(exist_ok=True)
        for rel, path in files:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(path, dst / rel)
    make_read_only(input_dir)


class Session:
    """A running kernel version. `kill` may come from any thread; the session then ends as `kill_status`
    with the reason as its failure message, and its /kaggle/working output is discarded."""

    def __init__(self, rt: Runtime, kernel: dict, v: dict, kill_fault: dict | None, forget: Callable[[], None]):
        self.rt = rt
        self.forget = forget  # the scheduler's: called once the end is recorded
        self.kernel = kernel
        self.v = v
        self.ref = kernel["ref"]
        self.number = v["number"]
        self.limit_s = v["limit_s"]
        self.kill_fault = kill_fault
        self.vdir = rt.store.kernel_dir(kernel, v["number"])
        self.proc: subprocess.Popen | None = None
        self.started = time.time()
        self.kill_reason: str | None = None
        self.kill_status = "ERROR"
        self.log_lock = threading.Lock()
        self.done = threading.Event()
        self.token: str | None = None  # the session's own access token, revoked when it ends

    def kill(self, reason: str, status: str = "ERROR") -> None:
        if self.kill_reason is None:
            self.kill_reason = reason
            self.kill_status = status
        proc = self.proc
        if proc is not None and proc.poll() is None:
            _kill_group(proc)

    def _prepare(self, kroot: Path) -> tuple[Path, dict[str, str]]:
        """Kaggle's folders, the script (a notebook's code cells), the secrets file; -> (script, environment)."""
        for sub in ("working", "temp"):
            (kroot / sub).mkdir(parents=True, exist_ok=True)
        materialize_inputs(self.rt, self.v, kroot / "input")
        text = (self.vdir / "source.txt").read_text(encoding="utf-8")
        if self.kernel.get("kernel_type") == "notebook":
            text = notebook_to_script(text)
        src = self.vdir / "src"
        src.mkdir(exist_ok=True)
        script = src / f"{self.kernel['slug']}.py"
        script.write_text(text, encoding="utf-8")
        secrets_file = self.vdir / "secrets.json"
        atomic_write_json(secrets_file, self.rt.secrets_of(self.ref), mode=0o600)
        self.token = self.rt.issue_token(self.kernel["owner"], float(self.v.get("started") or self.started)
                                         + float(self.limit_s))
        token_file = self.vdir / "notebook-token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        env = session_env(self.kernel, self.v, kroot, secrets_file, self.rt.proxy_url(), token_file)
        if self.rt.settings.disk_bytes:  # what the session reads as its disk (shared/kaggle/disk.py)
            env[LOCAL_DISK_ENV] = str(self.rt.settings.disk_bytes)
        return script, env

    def run(self) -> None:
        """From start to end, in the session's own thread; whatever happens, the version ends with a status."""
        try:
            fault = self.rt.faults.take_session_error(self.ref)
            if fault is not None:
                self._finish("ERROR", fault["message"], keep_outputs=False)
                return
            kroot = self.vdir / "kaggle"
            script, env = self._prepare(kroot)
            self.started = time.time()
            with open(self.vdir / "log.jsonl", "a", encoding="utf-8") as log:
                self.proc = subprocess.Popen(
                    [self.rt.settings.pythons[self.v.get("accelerator") or "cpu"], str(script)],
                    cwd=kroot / "working",
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                )
                if self.kill_reason is not None:  # stopped before the process existed
                    self.kill(self.kill_reason, self.kill_status)
                readers = [
                    threading.Thread(target=self._pump, args=(stream, name, log), daemon=True)
                    for stream, name in ((self.proc.stdout, "stdout"), (self.proc.stderr, "stderr"))
                ]
                for r in readers:
                    r.start()
                self._watch(kroot / "working")
                for r in readers:
                    r.join(10)
            rc = self.proc.returncode
            if self.kill_reason is not None:
                self._finish(self.kill_status, self.kill_reason, keep_outputs=False)
            elif rc == 0:
                self._finish("COMPLETE", None, keep_outputs=True)
            else:
                self._finish("ERROR", f"Kernel process exited with code {rc}", keep_outputs=True)
        except Exception as err:
            if self.proc is not None and self.proc.poll() is None:
                self.kill("internal error")
            self._finish("ERROR", f"The local Kaggle failed to run the session: {err!r}", keep_outputs=False)

    def _pump(self, stream: IO[bytes], name: str, log: IO[str]) -> None:
        """Copy one output stream into the log, line by line; an `on_log` kill fault fires on its line."""
        pattern = self.kill_fault.get("on_log") if self.kill_fault else None
        for raw in iter(stream.readline, b""):
            data = raw.decode("utf-8", errors="replace")
            event = {"stream_name": name, "time": round(time.time() - self.started, 3), "data": data}
            with self.log_lock:
                log.write(json.dumps(event) + "\n")
                log.flush()
            if pattern and re.search(pattern, data):
                self.kill(self.kill_fault["message"])
        stream.close()

    def _watch(self, working: Path) -> None:
        """Until the process exits: kill it at the time limit, an `after_s` kill fault, the end of the quota, or
        /kaggle/working over its cap, or its folders over the disk (Settings.disk_bytes: sizes checked twice a
        second)."""
        proc, accel, settings = self.proc, self.v.get("accelerator"), self.rt.settings
        next_size_check = 0.0
        while proc.poll() is None:
            now = time.time()
            elapsed = now - self.started
            if elapsed >= self.limit_s:
                self.kill(
                    f"Session exceeded its time limit of {self.limit_s:g} seconds and was killed; "
                    "its /kaggle/working output was not saved"
                )
            fault = self.kill_fault
            if fault and fault.get("after_s") is not None and elapsed >= float(fault["after_s"]):
                self.kill(fault["message"])
            reason = self.rt.quota.stop_reason(self.kernel["owner"], accel, now) if accel is not None else None
            if reason is not None:
                self.kill(reason)
            if now >= next_size_check:
                size = dir_size(working)
                if size > settings.working_cap_bytes:
                    self.kill(
                        f"/kaggle/working grew to {size} bytes, over its {settings.working_cap_bytes}-byte limit; "
                        "the session was stopped"
                    )
                self._check_disk(working)
                next_size_check = now + 0.5
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc)  # the process group may have children left

    def _check_disk(self, working: Path) -> None:
        """A session whose /kaggle/working and /kaggle/temp hold more than the modelled disk is stopped, as a write
        to a full disk would fail it (hard links counted once)."""
        disk = self.rt.settings.disk_bytes
        if not disk:
            return
        used = used_bytes(working, working.parent / "temp")
        if used > disk:
            self.kill(f"No space left on device: /kaggle/working and /kaggle/temp hold {used} bytes of a "
                      f"{disk}-byte disk; the session was stopped")

    def _finish(self, status: str, message: str | None, keep_outputs: bool) -> None:
        """Record the end, drop the session's temp, inputs and secrets (and its output unless kept)."""
        with self.rt.store.lock:
            self.v["status"] = status
            self.v["failure_message"] = message
            self.v["ended"] = time.time()
            self.v["outputs_saved"] = keep_outputs
            self.forget()
            self.rt.store.save()
        kroot = self.vdir / "kaggle"
        if not keep_outputs:
            shutil.rmtree(kroot / "working", ignore_errors=True)
        for sub in ("temp", "input"):
            make_writable(kroot / sub)
            shutil.rmtree(kroot / sub, ignore_errors=True)
        (self.vdir / "secrets.json").unlink(missing_ok=True)
        if self.token is not None:
            self.rt.revoke_token(self.token)
        (self.vdir / "notebook-token").unlink(missing_ok=True)
        self.done.set()


class Scheduler:
    """Starts queued kernel versions in push order, as many at once as each kind of machine allows (TPU, GPU, CPU),
    after a short queued time; and cancels, kills and stops the sessions it started."""

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.sessions: dict[tuple[str, int], Session] = {}  # (kernel ref, version) -> running session

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(0.05):
            try:
                self.schedule_once()
            except Exception as err:  # keep scheduling; report
                print(f"local-kaggle: scheduler error: {err!r}", file=sys.stderr)

    def schedule_once(self) -> None:
        store, settings = self.rt.store, self.rt.settings
        with store.lock:
            versions = [(kernel, v) for kernel in store.state["kernels"].values() for v in kernel["versions"]]
            running = {"tpu": 0, "gpu": 0, "cpu": 0}
            for _kernel, v in versions:
                if v["status"] == "RUNNING":
                    running[v.get("accelerator") or "cpu"] += 1
            queued = sorted(((v["queued_at"], kernel, v) for kernel, v in versions if v["status"] == "QUEUED"),
                            key=lambda item: item[0])
            now = time.time()
            for queued_at, kernel, v in queued:
                kind = v.get("accelerator") or "cpu"
                if queued_at + settings.queue_delay_s > now or running[kind] >= settings.concurrency[kind]:
                    continue
                running[kind] += 1
                v["status"] = "RUNNING"
                v["started"] = now
                key = (kernel["ref"], v["number"])
                session = Session(self.rt, kernel, v, self.rt.faults.take_kill(kernel["ref"]),
                                  forget=lambda key=key: self.sessions.pop(key, None))
                self.sessions[key] = session
                store.save()
                threading.Thread(target=session.run, daemon=True).start()

    def cancel(self, user: str, session_id: int) -> str | None:
        """CancelKernelSession names the session (one version of a kernel) by its kernelSessionId only; -> None, or
        why there was nothing to cancel (the reply's `error_message`)."""
        store = self.rt.store
        with store.lock:
            found = [(k, v) for k in store.state["kernels"].values() for v in k["versions"]
                     if v.get("session_id") == session_id]
            if not found:
                raise ApiError(404, f"Kernel session {session_id} not found")
            kernel, v = found[0]
            check_owner(user, kernel, "kernel")
            if v["status"] in TERMINAL:
                return f"Kernel session {session_id} has already ended ({v['status']})"
            session = self.sessions.get((kernel["ref"], v["number"]))
            if v["status"] == "QUEUED":
                v["status"] = "CANCEL_ACKNOWLEDGED"
                v["failure_message"] = "Cancelled by the user"
                v["ended"] = time.time()
                store.save()
        if session is not None:
            session.kill("Cancelled by the user", status="CANCEL_ACKNOWLEDGED")
        return None

    def kill(self, ref: str, reason: str) -> bool:
        """Kill the kernel's running sessions; False when it has none."""
        with self.rt.store.lock:
            running = [s for (r, _), s in self.sessions.items() if r == ref]
        for s in running:
            s.kill(reason)
        return bool(running)

    def stop_all(self, reason: str) -> None:
        """Kill every running session and wait (a while) for each to record its end."""
        with self.rt.store.lock:
            running = list(self.sessions.values())
        for s in running:
            s.kill(reason)
        for s in running:
            s.done.wait(10)
