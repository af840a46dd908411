"""Kernels and their versions: pushing (a new version, queued to run; a notebook's code cells run as a script),
lookups, each version's folder, outputs and log, delete. The sessions that run them are `sessions.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from kagglesdk.kernels.types.kernels_api_service import ApiSaveKernelRequest
from kagglesdk.kernels.types.kernels_enums import KernelExecutionType

from .datasets import Datasets
from .rules import (
    DEFAULT_GPU_SHAPE,
    DEFAULT_TPU_SHAPE,
    MACHINE_SHAPES,
    SLUG_RE,
    SUBSTITUTED_SHAPES,
    TERMINAL,
    ApiError,
    Settings,
    check_access,
    check_owner,
    split_ref,
)
from .state import Quota, Store


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

    def source(self, kernel: dict, number: int | None = None) -> str:
        """Version `number`'s pushed text (.py, or the .ipynb JSON of a notebook); the newest's by default."""
        number = kernel["versions"][-1]["number"] if number is None else number
        return (self.store.kernel_dir(kernel, number) / "source.txt").read_text("utf-8")

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
