"""Datasets and the uploads they are made of.

Here: `Uploads`, the blob uploads the client makes for dataset files (StartBlobUpload, then a resumable PUT to a
URL on this server); `Datasets`: create, new versions (from uploaded files, never touching the old versions),
lookups, delete, and the files and zips that downloads serve; which versions are live and ready. Files land in a
version or a session's inputs as hard links (shared.fsutil.link_or_copy).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
import uuid
import zipfile
from collections.abc import Iterable
from pathlib import Path

from kagglesdk.blobs.types.blob_api_service import ApiStartBlobUploadRequest
from kagglesdk.datasets.types.dataset_api_service import (
    ApiCreateDatasetRequest,
    ApiCreateDatasetVersionRequestBody,
    ApiDatasetNewFile,
)

from shared.fsutil import link_or_copy

from .rules import SLUG_RE, ApiError, Faults, Settings, check_access, check_owner, split_ref
from .state import Store

STATUS_QUERY = re.compile(r"bytes \*/\d+$")  # Content-Range of a resumable upload asking how far it got


def _received_range(received: int) -> dict[str, str]:
    """The `Range` header of a 308 reply: the bytes received so far (none: no header)."""
    return {"Range": f"bytes=0-{received - 1}"} if received else {}


class Uploads:
    """Blob uploads, as the client makes them for dataset files: StartBlobUpload gives a token and a URL on this
    server, then the file goes up in a resumable PUT (as against Google Cloud Storage). A dataset version takes the
    uploaded files by token. A failed_upload fault fails every PUT of one upload with a 500, which the client does
    not resume (kaggle/api/kaggle_api_extended.py 2.2.4:8700-8703 resumes only a 503)."""

    def __init__(self, store: Store, faults: Faults | None = None):
        self.store = store
        self.faults = faults or Faults()

    def path(self, token: str) -> Path:
        return self.store.root / "blobs" / token

    def start(self, user: str, req: ApiStartBlobUploadRequest) -> str:
        """A new upload of the file the request names; -> its token (the upload URL is /_upload/<token>)."""
        name = os.path.basename(req.name)
        if not name:
            raise ApiError(400, "StartBlobUpload needs a file name")
        token = uuid.uuid4().hex
        with self.store.lock:
            self.store.state["uploads"][token] = {
                "user": user,
                "name": name,
                "size": req.content_length,
                "received": 0,
                "complete": False,
                "created": time.time(),
                **({"failing": True} if self.faults.take_failed_upload(name) else {}),
            }
            self.path(token).touch()
            self.store.save()
        return token

    def receive(self, token: str, content_range: str, body: Iterable[bytes]) -> tuple[int, dict, dict | None]:
        """One PUT to the upload URL: (HTTP status, headers, JSON reply or None for an empty one). `body` is read
        only when bytes are written, so a status query (`Content-Range: bytes */N`) leaves it unread."""
        with self.store.lock:
            up = self.store.state["uploads"].get(token)
            if up is None:
                raise ApiError(404, f"Unknown upload {token!r}")
            up = dict(up)
        if up.get("failing"):
            raise ApiError(500, f"Injected fault: the upload of {up['name']!r} failed")
        if up.get("used_by"):
            if STATUS_QUERY.match(content_range):
                return 200, {}, None  # a status query: it is complete
            raise ApiError(400, f"Upload {token!r} was already used by a dataset version")
        if STATUS_QUERY.match(content_range):
            return (200, {}, None) if up["complete"] else (308, _received_range(up["received"]), None)
        start = 0
        m = re.match(r"bytes (\d+)-(\d+)/(\d+)$", content_range)
        if m:
            start = int(m.group(1))
            if start > up["received"]:
                raise ApiError(400, f"Upload resumes at byte {start} but only {up['received']} were received")
        received = start
        with open(self.path(token), "r+b") as f:
            f.seek(start)
            f.truncate()
            for data in body:
                f.write(data)
                received += len(data)
            f.flush()
            os.fsync(f.fileno())
        complete = received == up["size"]
        with self.store.lock:
            rec = self.store.state["uploads"][token]
            rec["received"] = received
            rec["complete"] = complete
            self.store.save()
        if complete:
            return 200, {}, {"token": token}
        if received < up["size"]:
            return 308, _received_range(received), None
        raise ApiError(400, f"Upload is {received} bytes but {up['size']} were declared")

    def files_for_version(self, user: str, files: list[ApiDatasetNewFile]) -> list[tuple[str, Path, str | None, str]]:
        """(name, bytes, description, token) of each file a new dataset version names by upload token."""
        if not files:
            raise ApiError(400, "A dataset version needs at least one file; none were uploaded")
        out, names = [], set()
        for f in files:
            token = f.token
            up = self.store.state["uploads"].get(token)
            if up is None or up["user"] != user:
                raise ApiError(400, f"Unknown upload token {token!r}")
            if not up["complete"]:
                raise ApiError(400, f"Upload of {up['name']!r} is incomplete ({up['received']}/{up['size']} bytes)")
            if up["name"] in names:
                raise ApiError(400, f"Two files named {up['name']!r} in one version")
            names.add(up["name"])
            source = self.path(token)
            if not source.exists():  # already used by a version (a client retry): link from that copy
                source = Path(up.get("used_by") or source)
                if not source.exists():
                    raise ApiError(400, f"Upload of {up['name']!r} is no longer available; upload it again")
            out.append((up["name"], source, f.description or None, token))
        return out

    def used_by(self, token: str, path: Path) -> None:
        """A version holds the upload's bytes at `path` now: drop the blob, remember where they went."""
        self.store.state["uploads"][token]["used_by"] = str(path)
        self.path(token).unlink(missing_ok=True)


def live_versions(ds: dict) -> list[dict]:
    """The versions not deleted (by `delete_old_versions`), oldest first."""
    return [v for v in ds["versions"] if not v.get("deleted")]


def is_ready(version: dict) -> bool:
    return version["ready_at"] <= time.time()


class Datasets:
    """Datasets and their versions, in the state and under <root>/datasets/<owner>/<slug>/<number>/."""

    def __init__(self, store: Store, uploads: Uploads, settings: Settings):
        self.store = store
        self.uploads = uploads
        self.settings = settings
        self.zip_lock = threading.Lock()

    def get(self, ref: str) -> dict:
        owner, slug = split_ref(ref, "dataset")
        ds = self.store.state["datasets"].get(f"{owner}/{slug}")
        if ds is None or ds.get("deleted"):
            raise ApiError(404, f"Dataset '{owner}/{slug}' not found")
        return ds

    def visible(self, user: str, ref: str) -> dict:
        """The dataset `ref` if `user` may read it."""
        ds = self.get(ref)
        check_access(user, ds["owner"], ds["is_private"], f"dataset '{ds['ref']}'")
        return ds

    def version(self, ds: dict, number: int | None, live: list[dict] | None = None) -> dict:
        """Version `number`, or (None or 0) the newest ready one of `live` (default: every live version)."""
        if number:
            for v in live_versions(ds):
                if v["number"] == number:
                    return v
            raise ApiError(404, f"Dataset '{ds['ref']}' has no version {number}")
        return self.ready_versions(ds, live)[-1]

    @staticmethod
    def ready_versions(ds: dict, live: list[dict] | None = None) -> list[dict]:
        """The ready versions of `live` (default: every live version), oldest first; 404 when there is none."""
        ready = [v for v in (live_versions(ds) if live is None else live) if is_ready(v)]
        if not ready:
            raise ApiError(404, f"Dataset '{ds['ref']}' has no ready version yet")
        return ready

    def _write_version(self, ds: dict, files: list[tuple[str, Path, str | None, str]], notes: str | None) -> dict:
        """Materialize a new version next to the old ones; existing versions are never touched."""
        numbers = [v["number"] for v in ds["versions"]]
        base = self.store.root / "datasets" / ds["owner"] / ds["slug"]
        base.mkdir(parents=True, exist_ok=True)
        existing = [int(p.name) for p in base.iterdir() if p.name.isdigit()]
        number = max(numbers + existing + [0]) + 1
        tmp = base / f".tmp-{number}-{uuid.uuid4().hex}"
        tmp.mkdir()
        entries = []
        for name, blob, description, _token in files:
            link_or_copy(blob, tmp / name)
            os.chmod(tmp / name, 0o444)
            entries.append({"name": name, "size": (tmp / name).stat().st_size, "description": description})
        os.rename(tmp, base / str(number))
        for name, _blob, _description, token in files:
            self.uploads.used_by(token, base / str(number) / name)
        now = time.time()
        version = {
            "number": number,
            "created": now,
            "notes": notes,
            "files": entries,
            "ready_at": now + self.settings.dataset_ready_delay_s,
            "creator": ds["owner"],
        }
        ds["versions"].append(version)
        ds["updated"] = now
        return version

    def over_quota(self, user: str, files: list[ApiDatasetNewFile]) -> bool:
        """Whether a new version of `files` would put `user`'s live private dataset versions over
        Settings.private_dataset_quota_bytes (older versions a deleting create would drop still count)."""
        quota = self.settings.private_dataset_quota_bytes
        if not quota:
            return False
        with self.store.lock:
            uploads = self.store.state["uploads"]
            new = sum(uploads[f.token]["size"] for f in files or [] if f.token in uploads)
            held = sum(f["size"] for ds in self.store.state["datasets"].values()
                       if ds["owner"] == user and ds.get("is_private") and not ds.get("deleted")
                       for v in live_versions(ds) for f in v["files"])
        return held + new > quota

    def create(self, user: str, req: ApiCreateDatasetRequest) -> str | None:
        """A new dataset from uploaded files; -> None, or why it was not created (the reply's `error`)."""
        owner, slug = req.owner_slug or user, req.slug
        if not SLUG_RE.match(slug or "-"):
            raise ApiError(400, f"Invalid dataset slug {slug!r}")
        if owner != user:
            raise ApiError(403, f"Permission denied: cannot create a dataset owned by {owner!r} as {user!r}")
        ref = f"{owner}/{slug}"
        with self.store.lock:
            existing = self.store.state["datasets"].get(ref)
            if existing is not None and not existing.get("deleted"):
                return f"The dataset '{ref}' already exists; push a new version"
            files = self.uploads.files_for_version(user, req.files)
            ds = {
                "id": self.store.next_id(),
                "ref": ref,
                "owner": owner,
                "slug": slug,
                "title": req.title or slug,
                "subtitle": req.subtitle or None,
                "description": req.description or None,
                "license": req.license_name or "unknown",
                "is_private": req.is_private,
                "created": time.time(),
                "versions": existing["versions"] if existing else [],
            }
            self._write_version(ds, files, "Initial release")
            self.store.state["datasets"][ref] = ds
            self.store.save()
        return None

    def create_version(self, user: str, ref: str | None, body: ApiCreateDatasetVersionRequestBody | None,
                       dataset_id: int | None = None) -> str:
        """A new version of the dataset `ref` (owner/slug), or of the one with `dataset_id`; -> the dataset's ref."""
        with self.store.lock:
            if dataset_id is not None:
                matches = [d for d in self.store.state["datasets"].values() if d["id"] == dataset_id]
                if not matches or matches[0].get("deleted"):
                    raise ApiError(404, f"Dataset with id {dataset_id} not found")
                ds = matches[0]
            else:
                ds = self.get(ref)
            check_owner(user, ds, "dataset")
            body = body or ApiCreateDatasetVersionRequestBody()
            files = self.uploads.files_for_version(user, body.files)
            version = self._write_version(ds, files, body.version_notes or None)
            if body.subtitle:
                ds["subtitle"] = body.subtitle
            if body.description:
                ds["description"] = body.description
            if body.delete_old_versions:
                for v in live_versions(ds):
                    if v["number"] != version["number"]:
                        v["deleted"] = True
                        shutil.rmtree(self.store.dataset_dir(ds, v["number"]), ignore_errors=True)
            self.store.save()
        return ds["ref"]

    def update_metadata(self, user: str, ref: str, settings) -> list[str]:
        """UpdateDatasetMetadata: the owner's settings (a kagglesdk DatasetSettings, or None) over the dataset's
        title, subtitle, description, privacy and license; -> the errors that kept them from being written (none:
        written). No version is made. What Kaggle checks is not verified: a title outside 6-50 characters is an
        error, as kaggle 2.2.4 refuses one at a create (kaggle_api_extended.py L5572-5573)."""
        with self.store.lock:
            ds = self.get(ref)
            check_owner(user, ds, "dataset")
            if settings is None:
                return []
            title = settings.title or ds["title"]
            if not 6 <= len(title) <= 50:
                return [f"Title must be between 6 and 50 characters, got {len(title)}"]
            ds.update(title=title, subtitle=settings.subtitle or None, description=settings.description or None,
                      is_private=bool(settings.is_private))
            if settings.licenses:
                ds["license"] = settings.licenses[0].name or ds["license"]
            self.store.save()
        return []

    def delete(self, user: str, ref: str) -> None:
        with self.store.lock:
            ds = self.get(ref)
            check_owner(user, ds, "dataset")
            ds["deleted"] = True
            self.store.save()

    def version_dir(self, ref: str, number: int) -> Path:
        """Where version `number`'s files are, for downloads."""
        with self.store.lock:
            ds = self.get(ref)
            self.version(ds, number)  # 404 unless it exists
            return self.store.dataset_dir(ds, number)

    def zip_file(self, ref: str, number: int) -> Path:
        """Version `number` as one zip (made once, stored uncompressed), for a download of the whole dataset."""
        with self.store.lock:
            ds = self.get(ref)
            version = dict(self.version(ds, number))
            src = self.store.dataset_dir(ds, version["number"])
            zpath = self.store.root / "zips" / ds["owner"] / ds["slug"] / f"{version['number']}.zip"
        with self.zip_lock:  # outside the state lock: zipping a big dataset takes a while
            if zpath.exists():
                return zpath
            zpath.parent.mkdir(parents=True, exist_ok=True)
            tmp = zpath.with_name(f".{zpath.name}.{uuid.uuid4().hex}.tmp")
            with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as z:
                for f in version["files"]:
                    z.write(src / f["name"], f["name"])
            os.replace(tmp, zpath)
            return zpath
