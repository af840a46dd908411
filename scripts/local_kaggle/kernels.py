"""Kernels and their sessions: pushing, running, and what a run leaves.

Here: `Kernels`: push (a new version, queued to run; a notebook's code cells run as a script), lookups, each
version's folder, outputs and log, delete. `Scheduler`: starts queued versions in push order, as many at once as
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kagglesdk.kernels.types.kernels_api_service import ApiSaveKernelRequest
from kagglesdk.kernels.types.kernels_enums import KernelExecutionType

from shared.fsutil import link_or_copy

from .datasets import Datasets
from .rules import (
    DEFAULT_GPU_SHAPE,
    DEFAULT_TPU_SHAPE,
    MACHINE_SHAPES,
    SLUG_RE,
    SUBSTITUTED_SHAPES,
    TERMINAL,
    ApiError,
    Faults,
    Settings,
    check_access,
    check_owner,
    split_ref,
)
from .server import proxy_env
from .state import Quota, Store, atomic_write_json

# ----- kernels and their versions -----


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


def _kind(req: ApiSaveKernelRequest, kernel: dict | None) -> tuple[str, str]:
    """(language, kernel_type) of a push, defaulting to the kernel's; only python scripts and notebooks run here."""
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
    return language, kernel_type


def _machine(req: ApiSaveKernelRequest) -> tuple[str | None, str | None]:
    """(machine shape it runs on, what it counts against: "tpu", "gpu" or None for CPU) of a push."""
    shape = req.machine_shape or None
    if shape is not None and shape not in MACHINE_SHAPES:
        raise ApiError(400, f"Unknown machine_shape {shape!r}; valid: {', '.join(sorted(MACHINE_SHAPES))}")
    tpu, gpu = req.enable_tpu, req.enable_gpu
    if shape is None and tpu and gpu:
        raise ApiError(400, "enable_tpu and enable_gpu are both true; choose one accelerator")
    if shape is None:
        shape = DEFAULT_TPU_SHAPE if tpu else DEFAULT_GPU_SHAPE if gpu else None
    shape = SUBSTITUTED_SHAPES.get(shape, shape)  # a retired shape runs on its successor
    return shape, MACHINE_SHAPES.get(shape) if shape else None


class Kernels:
    """Kernels and their versions, in the state and under <root>/kernels/<owner>/<slug>/<number>/."""

    def __init__(self, store: Store, settings: Settings, quota: Quota, datasets: Datasets):
        self.store = store
        self.settings = settings
        self.quota = quota
        self.datasets = datasets

    def get(self, ref: str) -> dict:
        owner, slug = split_ref(ref, "kernel")
        kernel = self.store.state["kernels"].get(f"{owner}/{slug}")
        if kernel is None:
            raise ApiError(404, f"Kernel '{owner}/{slug}' not found")
        return kernel

    def visible(self, user: str, ref: str) -> dict:
        """The kernel `ref` if `user` may read it."""
        kernel = self.get(ref)
        check_access(user, kernel["owner"], kernel.get("is_private", True), f"kernel '{kernel['ref']}'")
        return kernel

    def _source_exists(self, user: str, kind: str, ref: str) -> bool:
        try:
            self.datasets.visible(user, ref) if kind == "dataset" else self.visible(user, ref)
        except ApiError:
            return False
        return True

    def _find(self, user: str, req: ApiSaveKernelRequest) -> tuple[str, dict | None]:
        """The ref a push names (by id or slug) and its kernel, None for a new one; only the owner pushes."""
        if req.id:
            kernel = next((k for k in self.store.state["kernels"].values() if k["id"] == req.id), None)
            if kernel is None:
                raise ApiError(404, f"Kernel with id {req.id} not found")
            ref = kernel["ref"]
        else:
            owner, slug = split_ref(req.slug, "kernel")
            if not SLUG_RE.match(slug):
                raise ApiError(400, f"Invalid kernel slug {slug!r}")
            ref = f"{owner}/{slug}"
            kernel = self.store.state["kernels"].get(ref)
        if ref.split("/")[0] != user:
            raise ApiError(403, f"Permission denied: cannot push kernel '{ref}' as {user!r}")
        return ref, kernel

    def _sources(self, user: str, req: ApiSaveKernelRequest) -> tuple[dict[str, list[str]], list[str], list[str]]:
        """(the version's sources, the dataset and the kernel sources that do not exist or `user` may not read)."""
        datasets = list(req.dataset_data_sources)
        kernels = list(req.kernel_data_sources)
        invalid_ds = [d for d in datasets if not self._source_exists(user, "dataset", d)]
        invalid_k = [k for k in kernels if not self._source_exists(user, "kernel", k)]
        sources = {
            "dataset_sources": [d for d in datasets if d not in invalid_ds],
            "kernel_sources": [k for k in kernels if k not in invalid_k],
            "competition_sources": list(req.competition_data_sources),
        }
        return sources, invalid_ds, invalid_k

    def _saved_kernel(self, user: str, ref: str, kernel: dict | None, req: ApiSaveKernelRequest,
                      kind: tuple[str, str], now: float) -> dict:
        """The kernel's record, created on its first push, with what this push says of it."""
        if kernel is None:
            kernel = {"id": self.store.next_id(), "ref": ref, "owner": user, "slug": ref.split("/")[1],
                      "created": now, "versions": []}
            self.store.state["kernels"][ref] = kernel
        kernel["title"] = req.new_title or kernel.get("title") or kernel["slug"]
        kernel["language"], kernel["kernel_type"] = kind
        if "is_private" in req:
            kernel["is_private"] = req.is_private
        kernel.setdefault("is_private", True)
        return kernel

    def _new_version_dir(self, kernel: dict, number: int, text: str) -> None:
        vdir = self.store.kernel_dir(kernel, number)
        if vdir.exists():  # left over from a crash between mkdir and save; never reuse it silently
            shutil.rmtree(vdir)
        vdir.mkdir(parents=True)
        (vdir / "source.txt").write_text(text, encoding="utf-8")

    def push(self, user: str, req: ApiSaveKernelRequest) -> dict[str, Any]:
        """A new version of the kernel (created on its first push), QUEUED for the scheduler; with QUICK_SAVE,
        saved and not run. -> the fields of the reply (ApiSaveKernelResponse): only `error` when refused."""
        with self.store.lock:
            ref, kernel = self._find(user, req)
            kind = _kind(req, kernel)
            shape, accel = _machine(req)
            # A quick save keeps the version without running it: no session, no quota, no output.
            quick = req.kernel_execution_type == KernelExecutionType.QUICK_SAVE
            refusal = self.quota.push_refusal(user, accel) if accel is not None and not quick else None
            if refusal is not None:
                return {"error": refusal}
            sources, invalid_ds, invalid_k = self._sources(user, req)
            limit = self.settings.session_limit_s
            if req.session_timeout_seconds:
                limit = min(limit, float(req.session_timeout_seconds))
            now = time.time()
            kernel = self._saved_kernel(user, ref, kernel, req, kind, now)
            number = len(kernel["versions"]) + 1
            self._new_version_dir(kernel, number, req.text)
            kernel["versions"].append({
                "number": number,
                "session_id": self.store.next_id(),
                "created": now,
                "queued_at": now,
                "status": "COMPLETE" if quick else "QUEUED",
                "quick_save": quick,
                "failure_message": None,
                "machine_shape": shape,
                "accelerator": accel,
                "enable_internet": req.enable_internet if "enable_internet" in req else True,
                **sources,
                "limit_s": limit,
                "started": None,
                "ended": now if quick else None,
                "outputs_saved": False,
            })
            self.store.save()
        return {
            "ref": f"/code/{ref}",
            "url": f"http://localhost/code/{ref}",
            "version_number": number,
            "kernel_id": kernel["id"],
            "invalid_dataset_sources": invalid_ds,
            "invalid_kernel_sources": invalid_k,
            "invalid_competition_sources": sources["competition_sources"],  # no competitions exist locally
        }

    def source(self, kernel: dict) -> str:
        """The newest version's pushed text (.py, or the .ipynb JSON of a notebook)."""
        return (self.store.kernel_dir(kernel, kernel["versions"][-1]["number"]) / "source.txt").read_text("utf-8")

    @staticmethod
    def output_version(kernel: dict) -> dict | None:
        """The version whose output `kernels output` serves: the newest finished one."""
        done = [v for v in kernel["versions"] if v["status"] in TERMINAL]
        return done[-1] if done else None

    def output_files(self, kernel: dict, version: dict) -> list[tuple[str, Path]]:
        """(path relative to /kaggle/working, file) of a version's saved output, sorted."""
        if not version.get("outputs_saved"):
            return []
        working = self.store.kernel_dir(kernel, version["number"]) / "kaggle" / "working"
        out = []
        for dirpath, dirs, files in os.walk(working):
            dirs.sort()
            for name in sorted(files):
                path = Path(dirpath) / name
                out.append((path.relative_to(working).as_posix(), path))
        return out

    def output_dir(self, ref: str, number: int) -> Path:
        """The saved /kaggle/working of version `number`, for downloads."""
        with self.store.lock:
            kernel = self.get(ref)
            version = next((v for v in kernel["versions"] if v["number"] == number), None)
            if version is None or not version.get("outputs_saved"):
                raise ApiError(404, "No such output")
            return self.store.kernel_dir(kernel, number) / "kaggle" / "working"

    def log_events(self, kernel: dict, number: int) -> list[dict]:
        """A version's log so far: {"stream_name", "time", "data"} per line of output."""
        path = self.store.kernel_dir(kernel, number) / "log.jsonl"
        events = []
        try:
            with open(path, encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        events.append(json.loads(line))
        except FileNotFoundError:
            pass
        return events

    def log_so_far(self, user: str, ref: str, number: int | None = None) -> tuple[int, list[dict], bool]:
        """(version number, its log so far, whether it had ended before the log was read) of version `number` of a
        kernel `user` may read (default: the newest), for `kaggle kernels logs`."""
        with self.store.lock:
            kernel = self.visible(user, ref)
            v = kernel["versions"][-1] if number is None else next(x for x in kernel["versions"]
                                                                     if x["number"] == number)
            ended = v["status"] in TERMINAL
        return v["number"], self.log_events(kernel, v["number"]), ended

    def delete(self, user: str, ref: str) -> None:
        with self.store.lock:
            kernel = self.get(ref)
            check_owner(user, kernel, "kernel")
            if any(v["status"] not in TERMINAL for v in kernel["versions"]):
                raise ApiError(400, f"Kernel '{kernel['ref']}' has a session queued or running")
            del self.store.state["kernels"][kernel["ref"]]
            self.store.save()
        shutil.rmtree(self.store.root / "kernels" / kernel["owner"] / kernel["slug"], ignore_errors=True)


# ----- sessions -----

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


def session_env(kernel: dict, v: dict, kroot: Path, secrets_file: Path, proxy_url: str) -> dict[str, str]:
    """The kernel's environment: this process's, minus any Kaggle credentials, proxies and (internet off) pip
    settings, plus what `shared.kaggle.env` reads to find the session's folders and secrets."""
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
    if internet:
        env["KAGGLE_API_ENVIRONMENT"] = "LOCALHOST"
        env["NO_PROXY"] = env["no_proxy"] = PACKAGE_INDEX_HOSTS
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
        return script, session_env(self.kernel, self.v, kroot, secrets_file, self.rt.proxy_url())

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
        /kaggle/working over its cap (its size checked twice a second)."""
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
                next_size_check = now + 0.5
            try:
                proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc)  # the process group may have children left

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
