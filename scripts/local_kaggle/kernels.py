"""Kernels: push (a new version, queued to run), lookups, each version's folder, outputs and log, delete, and the
kagglesdk message that describes one. Running the versions is sessions.py's."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from kagglesdk.kernels.types.kernels_api_service import ApiKernelMetadata, ApiSaveKernelRequest, ApiSaveKernelResponse
from kagglesdk.kernels.types.kernels_enums import KernelExecutionType

from .datasets import Datasets
from .errors import ApiError
from .notebook import notebook_to_script
from .quota import Quota
from .rules import (
    DEFAULT_GPU_SHAPE,
    DEFAULT_TPU_SHAPE,
    MACHINE_SHAPES,
    SLUG_RE,
    SUBSTITUTED_SHAPES,
    TERMINAL,
    Settings,
    check_access,
    check_owner,
    split_ref,
)
from .sdk import message, utc
from .store import Store


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

    def push(self, user: str, req: ApiSaveKernelRequest) -> ApiSaveKernelResponse:
        """A new version of the kernel (created on its first push), QUEUED for the scheduler; with QUICK_SAVE,
        saved and not run."""
        with self.store.lock:
            ref, kernel = self._find(user, req)
            language, kernel_type = _kind(req, kernel)
            shape, accel = _machine(req)
            # A quick save keeps the version without running it: no session, no quota, no output.
            quick = req.kernel_execution_type == KernelExecutionType.QUICK_SAVE
            refusal = self.quota.push_refusal(user, accel) if accel is not None and not quick else None
            if refusal is not None:
                return message(ApiSaveKernelResponse, error=refusal)
            datasets = list(req.dataset_data_sources)
            kernels_src = list(req.kernel_data_sources)
            competitions = list(req.competition_data_sources)
            invalid_ds = [d for d in datasets if not self._source_exists(user, "dataset", d)]
            invalid_k = [k for k in kernels_src if not self._source_exists(user, "kernel", k)]
            limit = self.settings.session_limit_s
            if req.session_timeout_seconds:
                limit = min(limit, float(req.session_timeout_seconds))
            now = time.time()
            if kernel is None:
                kernel = {"id": self.store.next_id(), "ref": ref, "owner": user, "slug": ref.split("/")[1],
                          "created": now, "versions": []}
                self.store.state["kernels"][ref] = kernel
            kernel["title"] = req.new_title or kernel.get("title") or kernel["slug"]
            kernel["language"] = language
            kernel["kernel_type"] = kernel_type
            if "is_private" in req:
                kernel["is_private"] = req.is_private
            kernel.setdefault("is_private", True)
            number = len(kernel["versions"]) + 1
            vdir = self.store.kernel_dir(kernel, number)
            if vdir.exists():  # left over from a crash between mkdir and save; never reuse it silently
                shutil.rmtree(vdir)
            vdir.mkdir(parents=True)
            (vdir / "source.txt").write_text(req.text, encoding="utf-8")
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
                "dataset_sources": [d for d in datasets if d not in invalid_ds],
                "kernel_sources": [k for k in kernels_src if k not in invalid_k],
                "competition_sources": competitions,
                "limit_s": limit,
                "started": None,
                "ended": now if quick else None,
                "outputs_saved": False,
            })
            self.store.save()
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

    def delete(self, user: str, ref: str) -> None:
        with self.store.lock:
            kernel = self.get(ref)
            check_owner(user, kernel, "kernel")
            if any(v["status"] not in TERMINAL for v in kernel["versions"]):
                raise ApiError(400, f"Kernel '{kernel['ref']}' has a session queued or running")
            del self.store.state["kernels"][kernel["ref"]]
            self.store.save()
        shutil.rmtree(self.store.root / "kernels" / kernel["owner"] / kernel["slug"], ignore_errors=True)


def kernel_reply(kernel: dict) -> ApiKernelMetadata:
    """The kagglesdk message describing a kernel, as of its newest version."""
    last = kernel["versions"][-1] if kernel["versions"] else {}
    shape = last.get("machine_shape")
    return message(
        ApiKernelMetadata,
        id=kernel["id"],
        ref=kernel["ref"],
        title=kernel.get("title", kernel["slug"]),
        author=kernel["owner"],
        slug=kernel["slug"],
        last_run_time=utc(last.get("started") or last.get("created")),
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
