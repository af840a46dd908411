"""A small Kaggle API client: every call the chain makes, retried with backoff on transient errors (429, 5xx,
connection) and failing as one line (ApiFailure) with any key masked; kernel status polling; output files
streamed to disk. It knows nothing of the chain: it gets a ClientConfig and the API object."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from scripts.chain.config import ClientConfig
from shared.errors import UserError, describe_error, duration_text, http_status, is_transient
from shared.kaggle.proof import read_dataset_version, wait_for_new_version

# KernelWorkerStatus (kagglesdk kernels_enums.py:31-38): CANCEL_REQUESTED is on the way to CANCEL_ACKNOWLEDGED.
TERMINAL = {"COMPLETE", "ERROR", "CANCEL_ACKNOWLEDGED"}
ACTIVE = {"QUEUED", "RUNNING", "NEW_SCRIPT", "CANCEL_REQUESTED"}


def status_name(status) -> str:
    text = getattr(status, "name", None) or str(status)
    return text.rsplit(".", 1)[-1].upper()


def stream_to_file(url: str, target: Path, chunk_bytes: int = 1 << 20) -> int:
    """GET `url` into `target` a chunk at a time (through a temporary file, renamed when complete); the size is
    checked against Content-Length. Returns the bytes written."""
    import requests

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    written = 0
    with requests.get(url, stream=True, timeout=(30, 300)) as resp:
        resp.raise_for_status()
        expected = resp.headers.get("Content-Length")
        encoded = resp.headers.get("Content-Encoding")
        size = int(expected) if expected and expected.isdigit() else None
        bar = None
        if size and size >= 256 << 20:  # a checkpoint: show how it goes (on stderr)
            from tqdm import tqdm

            bar = tqdm(total=size, unit="B", unit_scale=True, desc=target.name, mininterval=2.0)
        with open(partial, "wb") as out:
            for chunk in resp.iter_content(chunk_bytes):
                out.write(chunk)
                written += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
        if bar is not None:
            bar.close()
    if expected is not None and expected.isdigit() and int(expected) != written and not encoded:
        partial.unlink(missing_ok=True)
        raise OSError(f"{url}: {written} bytes arrived of {expected}")
    os.replace(partial, target)
    return written


def normalize_single_download(dest: Path, name: str) -> None:
    """The kaggle client names a downloaded file after its URL, and Kaggle may serve one file zipped: leave
    `dest/name` whichever way it came."""
    if (dest / name).is_file() and not zipfile.is_zipfile(dest / name):
        return
    files = [p for p in dest.iterdir() if p.is_file()]
    for f in files:
        if zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                members = [m for m in z.namelist() if Path(m).name == name]
                if members:
                    (dest / name).write_bytes(z.read(members[0]))
                    return
    if len(files) == 1 and files[0].name != name:
        files[0].rename(dest / name)


def version_label(version: int) -> str:
    """A kernel version as the API's `versionLabel` takes it: "v<N>"; a bare number is 404 (kaggle 2.2.5,
    kaggle/api/kaggle_api_extended.py `_kernel_version_label`, which its status, output and pull calls use)."""
    return f"v{version}"


class ApiFailure(UserError):
    """A Kaggle API call that failed for good (after retries where the error was transient)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class VersionMissing(UserError):
    """No dataset version newer than the one before a publish appeared (or became ready) in time."""

    def __init__(self, ref: str, above: int, number: int, status: str, timeout_s: float):
        newest = f"version {number}, {status or 'no status'}" if number else "no version at all: HTTP 404"
        super().__init__(f"no version of {ref} after version {above} was ready within {duration_text(timeout_s)} "
                         f"(Kaggle shows {newest})")
        self.ref, self.above, self.number = ref, above, number


class KaggleClient:
    """The chain's Kaggle calls on one API object (a KaggleApi, or a test's stand-in), as `user`."""

    # How long a new dataset version may take to appear and be processed before it counts as missing (a create
    # over the private-dataset quota reports success and never appears: kaggle-cli issue 284).
    dataset_wait_s: float = 3600.0

    def __init__(self, cfg: ClientConfig, api=None, user: str = "", log=print, sleep=time.sleep):
        self.cfg = cfg
        self.api = api
        self.user = user
        self.log = log
        self.sleep = sleep

    def connect(self) -> None:
        """The API from the machine's credentials (unless one was given); the user from the config or them."""
        from shared.kaggle.credential import kaggle_api

        if self.api is None:
            self.api = kaggle_api(from_secrets=False)
        api_user = self.api.get_config_value("username") or ""
        self.user = self.user or api_user
        if not self.user:
            raise UserError("no Kaggle user: set user in the config or KAGGLE_USERNAME")

    def call(self, what: str, fn: Callable, *args, **kwargs):
        """fn(*args), retried with exponential backoff on transient errors (429, 5xx, connection)."""
        delay = self.cfg.retry_base_s
        for attempt in range(1, self.cfg.retry_attempts + 1):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    return fn(*args, **kwargs)
            except UserError:
                raise
            except Exception as err:
                if not is_transient(err) or attempt == self.cfg.retry_attempts:
                    raise ApiFailure(f"{what}: {self.describe(err)}", http_status(err)) from None
                wait = delay
                retry_after = getattr(getattr(err, "response", None), "headers", {}).get("Retry-After")
                if retry_after and str(retry_after).isdigit():
                    wait = max(wait, float(retry_after))
                self.log(f"  {what}: {self.describe(err)}; retrying in {wait:g}s "
                         f"(attempt {attempt}/{self.cfg.retry_attempts})")
                self.sleep(wait)
                delay = min(delay * 2, 300)
        raise AssertionError("unreachable")

    def describe(self, err: BaseException) -> str:
        """One line for a failed call, with no key in it."""
        return describe_error(err, self.secrets())

    def secrets(self) -> list[str]:
        """The key from the environment and the one the client read (e.g. from kaggle.json): masked everywhere."""
        config = getattr(self.api, "config_values", None) or {}
        return [k for k in (os.environ.get("KAGGLE_KEY", ""), config.get("key", ""), config.get("token", "")) if k]

    def ref(self, slug: str) -> str:
        return f"{self.user}/{slug}"

    def dataset_exists(self, ref: str) -> bool:
        """404 is missing; 403 (it exists, but these credentials may not read it) is an error, not missing."""
        try:
            self.call(f"dataset {ref}", self.api.dataset_status, ref)
            return True
        except ApiFailure as err:
            if err.status == 404:
                return False
            if err.status in (401, 403):
                raise UserError(f"dataset {ref}: Kaggle refuses {self.user} access (HTTP {err.status}); it is "
                                "another user's private dataset, or the credentials are wrong") from None
            raise

    def kernel_info(self, ref: str, version: int = 0) -> tuple[int, str]:
        """(current version number, source of that version, or of version `version` where given, asked for by its
        label "v<N>" as kaggle 2.2.5 does) or (0, "") if the kernel (or that version) does not exist."""
        from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelRequest

        owner, slug = ref.split("/")

        def get():
            with self.api.build_kaggle_client() as client:
                req = ApiGetKernelRequest()
                req.user_name, req.kernel_slug = owner, slug
                if version:
                    req.version_label = f"v{version}"  # kaggle 2.2.5 kaggle_api_extended.py `_kernel_version_label`
                return client.kernels.kernels_api_client.get_kernel(req)

        try:
            resp = self.call(f"kernel {ref}", get)
        except ApiFailure as err:
            if err.status == 404:
                return 0, ""
            if err.status in (401, 403):
                raise UserError(f"kernel {ref}: Kaggle refuses {self.user} access (HTTP {err.status}); it is "
                                "another user's private kernel, or the credentials are wrong") from None
            raise
        return int(resp.metadata.current_version_number or 0), (resp.blob.source or "") if resp.blob else ""

    def quick_save(self, folder: Path) -> int:
        """Save the kernel built in `folder` as a new version without running it (kagglesdk's QUICK_SAVE
        execution type, which `kaggle kernels push` never sends): the notebook then exists, so secrets can be
        attached on its page before its first session. Returns the version number.

        It is saved without an accelerator: a user who opens the notebook to attach secrets may start an editor
        session on whatever machine the notebook names (not verified), which on a TPU would spend quota and may
        hold the TPU slot. Each later push names the machine (kernel-metadata.json's `machine_shape`)."""
        from kagglesdk.kernels.types.kernels_api_service import ApiSaveKernelRequest
        from kagglesdk.kernels.types.kernels_enums import KernelExecutionType

        meta = json.loads((folder / "kernel-metadata.json").read_text())

        def save():
            with self.api.build_kaggle_client() as client:
                req = ApiSaveKernelRequest()
                req.slug, req.new_title = meta["id"], meta["title"]
                req.text = (folder / meta["code_file"]).read_text()
                req.language, req.kernel_type = "python", meta["kernel_type"]
                req.is_private = bool(meta.get("is_private", True))
                req.enable_internet = bool(meta.get("enable_internet", True))
                req.enable_tpu = req.enable_gpu = False  # no machine_shape either: see above
                req.dataset_data_sources = list(meta.get("dataset_sources") or [])
                req.kernel_data_sources = list(meta.get("kernel_sources") or [])
                req.kernel_execution_type = KernelExecutionType.QUICK_SAVE
                return client.kernels.kernels_api_client.save_kernel(req)

        resp = self.call(f"quick save of {meta['id']}", save)
        if resp.error:
            raise UserError(f"quick save of {meta['id']} refused: {resp.error}")
        return int(resp.version_number or 0)

    def kernel_status(self, ref: str, version: int = 0) -> tuple[str, str]:
        """(status, failure message) of `ref`'s session: of version `version` where given (the reply names no
        version, so only a labelled request is sure to describe the version meant), else of the newest."""
        if not version:
            resp = self.call(f"status of {ref}", self.api.kernels_status, ref)
            return status_name(resp.status), getattr(resp, "failure_message", "") or ""
        from kagglesdk.kernels.types.kernels_api_service import ApiGetKernelSessionStatusRequest

        owner, slug = ref.split("/")

        def get():
            with self.api.build_kaggle_client() as client:
                req = ApiGetKernelSessionStatusRequest()
                req.user_name, req.kernel_slug, req.version_label = owner, slug, version_label(version)
                return client.kernels.kernels_api_client.get_kernel_session_status(req)

        resp = self.call(f"status of {ref} v{version}", get)
        return status_name(resp.status), resp.failure_message or ""

    def download_output(self, ref: str, dest: Path, pattern: str | None = None, version: int = 0) -> list[str]:
        """The output files of `ref`'s session (version `version` where given, else the newest finished) whose
        path matches `pattern` (re.search), each streamed to disk (an 18 GB checkpoint never sits in memory, unlike
        the kaggle client's kernels_output), and the session's log as `<slug>.log`, as the kaggle client writes it.
        Paths are checked to stay under `dest`."""
        from kagglesdk.kernels.types.kernels_api_service import ApiListKernelSessionOutputRequest

        owner, slug = ref.split("/")
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        wanted = re.compile(pattern) if pattern is not None else None
        files: list[str] = []
        token, log_text = "", None
        while True:
            def page(token=token):
                with self.api.build_kaggle_client() as client:
                    request = ApiListKernelSessionOutputRequest()
                    request.user_name, request.kernel_slug, request.page_size = owner, slug, 200
                    request.page_token = token
                    if version:
                        request.version_label = version_label(version)
                    return client.kernels.kernels_api_client.list_kernel_session_output(request)

            resp = self.call(f"output of {ref}", page)
            log_text = resp.log if log_text is None else log_text
            for item in resp.files or []:
                if wanted is not None and not wanted.search(item.file_name):
                    continue
                target = (dest / item.file_name).resolve()
                if not target.is_relative_to(dest.resolve()):
                    raise ApiFailure(f"output of {ref}: file name {item.file_name!r} points outside {dest}")
                self.call(f"output file {item.file_name} of {ref}", stream_to_file, item.url, target)
                files.append(str(target))
            token = resp.next_page_token
            if not token:
                break
        if log_text:
            (dest / f"{slug}.log").write_text(log_text)
            files.append(str(dest / f"{slug}.log"))
        return files

    # ----- the checkpoint dataset --------------------------------------------------------------------------------

    def dataset_version(self, ref: str) -> tuple[int, str]:
        """(current version number, status) of the dataset `ref`; (0, "") while Kaggle answers 404 (not created,
        or a create that never landed)."""
        try:
            return self.call(f"dataset {ref}", read_dataset_version, self.api, ref)
        except ApiFailure as err:
            if err.status == 404:
                return 0, ""
            raise

    def wait_dataset_version(self, ref: str, above: int, timeout_s: float | None = None) -> int:
        """Wait until the dataset has a version newer than `above` and it is ready; returns its number
        (`wait_for_new_version`: a status counts only once read after its version's number). Raises UserError for
        a failed or deleted version, VersionMissing when none appears within `timeout_s` (default
        dataset_wait_s)."""
        timeout_s = self.dataset_wait_s if timeout_s is None else timeout_s
        seen = wait_for_new_version(lambda: self.dataset_version(ref), above, timeout_s, self.sleep,
                                    self.cfg.poll_initial_s, self.cfg.poll_max_s)
        if not seen.settled:
            raise VersionMissing(ref, above, seen.number, seen.status, timeout_s)
        if seen.status != "ready":
            raise UserError(f"dataset {ref}: its version {seen.number} is {seen.status} on Kaggle; see the dataset's "
                            "page")
        return seen.number

    def private_datasets(self) -> dict[str, int]:
        """{ref: bytes} of this user's private datasets, every page, as ListDatasets lists them (kagglesdk 0.1.38
        datasets/services/dataset_api_service.py L11-21; its request's `group`, `page_size` and `page_token`, and
        ApiDataset's `total_bytes` and `is_private`, the reply's `next_page_token`:
        datasets/types/dataset_api_service.py L658-687, L2158-2176, L2381-2391; DATASET_SELECTION_GROUP_MY:
        dataset_enums.py L39). Whether `total_bytes` counts one version or all of them
        is not documented: what they take of the private-dataset quota is read as that figure."""
        from kagglesdk.datasets.types.dataset_api_service import ApiListDatasetsRequest
        from kagglesdk.datasets.types.dataset_enums import DatasetSelectionGroup

        found: dict[str, int] = {}
        token = ""
        for _ in range(1000):  # 100 000 datasets at most: a page token that never ends is not followed for ever
            def page(token=token):
                with self.api.build_kaggle_client() as client:
                    req = ApiListDatasetsRequest()
                    req.group, req.page_size = DatasetSelectionGroup.DATASET_SELECTION_GROUP_MY, 100
                    if token:
                        req.page_token = token
                    return client.datasets.dataset_api_client.list_datasets(req)

            resp = self.call("your datasets", page)
            found.update({d.ref: int(d.total_bytes or 0) for d in resp.datasets or [] if d.is_private})
            token = resp.next_page_token or ""
            if not token:
                break
        return found

    def quota_left_s(self, kind: str | None) -> tuple[float, float, str] | None:
        """(seconds left, seconds allowed, reset time) of the weekly quota of `kind` ("tpu", "gpu"), None for
        CPU (kind None)."""
        if kind is None or not hasattr(self.api, "quota_view"):  # CPU, or a kaggle client without quota calls
            return None
        resp = self.call("quota", self.api.quota_view)
        quota = getattr(resp, f"{kind}_quota", None)
        if quota is None:
            return None
        if quota.total_time_allowed is None:
            return None
        # A week with no use (or nothing reserved) may leave the field out: None, not zero.
        used = sum(t.total_seconds() for t in (quota.time_used, getattr(quota, "time_reserved", None)) if t)
        total = quota.total_time_allowed.total_seconds()
        reset = getattr(resp, "quota_refresh_time", None)
        return total - used, total, str(reset) if reset else "next Saturday"


def log_error_line(folder: Path, ref: str) -> str | None:
    """The last `error: ...` line `ref`'s session printed, from the log download_output wrote into `folder`
    (Kaggle's log is a JSON list of {stream_name, time, data}; plain text is read as it is), or None."""
    try:
        text = (Path(folder) / f"{ref.split('/')[-1]}.log").read_text()
    except OSError:
        return None
    try:
        entries = json.loads(text)
    except ValueError:
        entries = None
    if isinstance(entries, list):
        # Entry by entry: a chunk of one stream that ends mid-line must not run into the other's next line.
        text = "\n".join(str(entry.get("data", "")) for entry in entries if isinstance(entry, dict))
    errors = [line.strip() for line in text.splitlines() if line.startswith("error:")]
    return errors[-1] if errors else None
