"""Checkpoint dataset versions: reading the current one, waiting for a new one, and proving it.

A published checkpoint version is proven by its files: the names and sizes Kaggle lists for exactly that version
(ListDatasetFiles with its number; the listing gives no hashes: docs/kaggle-api.md) against those of the checkpoint
that was published. Used by a session verifying its own publish (shared/kaggle/publish.py) and by the chain
(scripts/chain/checkpoints.py).

Every read here is tried again after a transient fault (shared/kaggle/calls.py `kaggle_call`), within the time the
session has left.

Also: uploads that fail raise, as kaggle 2.2.5 does, rather than dropping the file from the version (kaggle 2.2.4's
`_upload_file` returns None on a failed blob upload, and the version is created without that file).

Only the standard library is imported.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

from shared.kaggle.calls import kaggle_call

LIST_PAGE_SIZE = 200
# The kaggle client and kagglesdk set no timeout of their own: each read of a dataset's versions or files (GetDataset,
# GetDatasetStatus, ListDatasetFiles) is given this long.
STATUS_TIMEOUT_S = 120.0


class UploadFailed(RuntimeError):
    """A file's blob upload failed: no version is created without it."""


def listed_files(api, dataset: str, number: int) -> dict[str, int]:
    """{name: bytes} of version `number` of `dataset` (owner/slug), every page, as ListDatasetFiles gives them.
    Raises the API's errors."""
    files: dict[str, int] = {}
    token = None
    while True:
        reply = api.dataset_list_files(f"{dataset}/{number}", page_token=token, page_size=LIST_PAGE_SIZE)
        for f in getattr(reply, "files", None) or []:
            files[f.name] = int(getattr(f, "total_bytes", 0) or 0)
        token = getattr(reply, "next_page_token", None)
        if not token:
            return files


def listing_problem(expected: dict[str, int | None], listed: dict[str, int]) -> str | None:
    """What a version's listing lacks against `expected` ({name: bytes}; None: any size), in a few words; None when
    every expected file is listed at its size. Extra files are no problem (a README, another tool's)."""
    missing = sorted(name for name in expected if name not in listed)
    wrong = sorted(f"{name} has {listed[name]} bytes, not {size}" for name, size in expected.items()
                   if name in listed and size is not None and listed[name] != size)
    parts = []
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        parts.append(f"lacks {shown}")
    parts += wrong[:2]
    return "; ".join(parts) or None


@contextlib.contextmanager
def failed_uploads_raise(api) -> Iterator[None]:
    """While inside: a file whose upload fails raises UploadFailed before any version is created. kaggle 2.2.4's
    `_upload_file` returns None then, and `upload_files` leaves the file out of the version it goes on to create
    (kaggle/api/kaggle_api_extended.py:8595-8599, 8513-8516); 2.2.5 raises ValueError itself (:9463)."""
    original = getattr(api, "_upload_file", None)
    if original is None:  # not the kaggle client (a test's fake): nothing to check
        yield
        return

    def checked(file_name, *args, **kwargs):
        uploaded = original(file_name, *args, **kwargs)
        if uploaded is None:
            raise UploadFailed(f"the upload of {file_name} failed; no version was created without it")
        return uploaded

    own = vars(api).get("_upload_file")  # an instance's own attribute, if any, is put back
    api._upload_file = checked
    try:
        yield
    finally:
        if own is None:
            del api._upload_file  # the class's method again
        else:
            api._upload_file = own


# --- versions: read, waited for, proven ------------------------------------------------------------------

def parse_dataset_status(reply: str) -> tuple[int, str]:
    """(current version number, status) from kaggle's `dataset_status(ref, format="json")`: it reads
    GetDatasetStatus, then GetDataset's currentVersionNumber; the status names no version (docs/kaggle-api.md)."""
    data = json.loads(reply)
    return int(data.get("current_version_number") or 0), str(data.get("status") or "").lower()


def _get_dataset(api, dataset: str):
    """GetDataset of `dataset` (owner/slug) through kagglesdk: ApiDataset."""
    from kagglesdk.datasets.types.dataset_api_service import ApiGetDatasetRequest

    request = ApiGetDatasetRequest()
    request.owner_slug, request.dataset_slug = dataset.split("/", 1)
    with api.build_kaggle_client() as kaggle:
        return kaggle.datasets.dataset_api_client.get_dataset(request)


def _get_dataset_status(api, dataset: str) -> str:
    """GetDatasetStatus of `dataset` through kagglesdk, lower-cased as the kaggle client gives it ("ready"). Not
    `api.dataset_status(ref, format="json")`: kaggle 2.0.2, the CPU and GPU images' (Kaggle/docker-python
    kaggle_requirements.txt), has no `format` (kaggle_api_extended.py L2357)."""
    from kagglesdk.datasets.types.dataset_api_service import ApiGetDatasetStatusRequest

    request = ApiGetDatasetStatusRequest()
    request.owner_slug, request.dataset_slug = dataset.split("/", 1)
    with api.build_kaggle_client() as kaggle:
        reply = kaggle.datasets.dataset_api_client.get_dataset_status(request)
    return str(getattr(reply.status, "name", reply.status) or "").lower()


# `ApiDatasetVersion.status` is a free string whose values no source lists (docs/kaggle-api.md); these, in any case,
# are read as a version's own status. Anything else falls back to GetDatasetStatus, which names no version.
VERSION_STATUSES = ("ready", "failed", "deleted", "pending", "processing")


def read_dataset_version(api, dataset: str) -> tuple[int, str]:
    """(current version number, status) of `dataset`: that version's own status from GetDataset's versions[]
    where it is one of VERSION_STATUSES, else GetDatasetStatus's, with the number GetDataset gives after it (as
    kaggle 2.2.4's `dataset_status(ref, format="json")` reads them, in any kaggle). Raises the API's errors (a 404
    too)."""
    reply = _get_dataset(api, dataset)
    number = int(reply.current_version_number or 0)
    own = [str(v.status or "").lower() for v in (reply.versions or []) if v.version_number == number]
    if own and own[0] in VERSION_STATUSES:
        return number, own[0]
    status = _get_dataset_status(api, dataset)
    return int(_get_dataset(api, dataset).current_version_number or 0), status


def dataset_version(api, dataset: str, log=print) -> tuple[int, str]:
    """(current version number, status) of `dataset` (`read_dataset_version`, within STATUS_TIMEOUT_S a try,
    tried again after a transient fault); (0, "") while Kaggle answers 404."""
    try:
        return kaggle_call(lambda: read_dataset_version(api, dataset), f"reading the version of {dataset}", log,
                           STATUS_TIMEOUT_S)
    except Exception as err:
        if getattr(getattr(err, "response", None), "status_code", None) == 404:
            return 0, ""
        raise


@dataclass
class VersionSeen:
    number: int  # the newest version number read
    status: str  # its status as read ("" on a 404)
    settled: bool  # a version above the one waited past, ready, failed or deleted, read after its number was seen


def wait_for_new_version(read, above: int, timeout_s: float, sleep=time.sleep, poll_s: float = 10.0,
                         poll_max_s: float = 60.0) -> VersionSeen:
    """Poll `read` (() -> (version number, status)) until a version newer than `above` is ready, failed or deleted,
    or timeout_s has passed. Right after a publish both calls behind a read may still describe the previous
    version, so a version counts only once it is higher than `above`, and its status only when read after that
    number was seen (the status names no version). Shared by the chain and a session verifying its publish."""
    interval, deadline, seen = poll_s, time.monotonic() + timeout_s, 0
    while True:
        number, status = read()
        if number > above and number == seen and status in ("ready", "failed", "deleted"):  # DatabundleVersionStatus
            return VersionSeen(number, status, True)
        fresh = number > above and number != seen
        seen = number if number > above else 0
        if time.monotonic() >= deadline:
            return VersionSeen(number, status, False)
        sleep(poll_s if fresh else interval)
        interval = interval if fresh else min(interval * 1.5, poll_max_s)


VERSION_POLL = (10.0, 60.0)  # a session's first and longest wait between reads of its new version (the chain's own)
LISTING_TRIES = 3  # listings of a ready version that name no file yet (a version is never empty: one that lags)


def prove_new_version(api, dataset: str, above: int, timeout_s: float, expected: dict | None,
                      sleep=time.sleep, poll: tuple[float, float] = VERSION_POLL,
                      log=print) -> tuple[VersionSeen, str | None]:
    """The first version of `dataset` above `above` (`wait_for_new_version`), and why it is not proven whole, None
    when it is: ready, and (with `expected`, {name: bytes or None}) listing every expected file at its size."""
    seen = wait_for_new_version(lambda: dataset_version(api, dataset, log), above, timeout_s, sleep, *poll)
    if not seen.settled:
        new = seen.number > above
        return seen, f"version {seen.number} is still {seen.status or 'processing'}" if new else \
            f"no version after {above} appeared"
    if seen.status != "ready":
        return seen, f"version {seen.number} is {seen.status}"
    if expected is None:
        return seen, None
    for _ in range(LISTING_TRIES):
        listed = kaggle_call(lambda: listed_files(api, dataset, seen.number),
                             f"listing version {seen.number} of {dataset}", log, STATUS_TIMEOUT_S)
        if listed:
            break
        sleep(poll[0])
    short = listing_problem(expected, listed)
    return seen, f"version {seen.number} {short}" if short else None


def verify_publish(api, dataset: str, before: int, timeout_s: float, republish, log=print,
                   sleep=time.sleep, expected: dict | None = None, poll: tuple[float, float] = VERSION_POLL) -> dict:
    """After a publish past version `before`: wait for its version and prove it whole (`prove_new_version`); one
    that failed, never appeared (a create over the quota answers "Ok": kaggle-cli issue 284) or lacks a file is
    published again by `republish()` (which keeps the dataset's versions), once. Returns what the publish record
    notes: `verified_version` (None where none was proven in time) and `republished`. Before publishing again,
    one more read: a version that landed after all (its create answered a fault, or the wait ended just before it
    appeared) is proven instead."""
    seen, problem = prove_new_version(api, dataset, before, timeout_s, expected, sleep, poll, log)
    if problem is None:
        return {"verified_version": seen.number, "republished": False}
    if seen.number <= before and dataset_version(api, dataset, log)[0] > before:
        log(f"publish: a version of {dataset} after {before} appeared after the wait; proving it before "
            "publishing again")
        seen, problem = prove_new_version(api, dataset, before, timeout_s, expected, sleep, poll, log)
        if problem is None:
            return {"verified_version": seen.number, "republished": False}
    if seen.number > before and not seen.settled:
        log(f"publish: version {seen.number} of {dataset} is still {seen.status or 'processing'} after "
            f"{timeout_s:.0f} s; the chain waits for it")
        return {"verified_version": None, "republished": False}
    log(f"warning: the publish to {dataset} did not land ({problem}); publishing the checkpoint again")
    republish()
    again, problem = prove_new_version(api, dataset, max(before, seen.number), timeout_s, expected, sleep, poll, log)
    if problem is None:
        return {"verified_version": again.number, "republished": True}
    log(f"warning: the second publish to {dataset} did not land either ({problem}); the checkpoint was lost with "
        "this session unless the chain finds it in the output")
    return {"verified_version": None, "republished": True}
