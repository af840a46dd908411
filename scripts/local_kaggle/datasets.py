"""Datasets: create, new versions (from uploaded files, never touching the old versions), lookups, delete, the
files and zips that downloads serve, and the kagglesdk message that describes one."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
import zipfile
from pathlib import Path

from kagglesdk.datasets.types.dataset_api_service import (
    ApiCreateDatasetRequest,
    ApiCreateDatasetResponse,
    ApiCreateDatasetVersionRequestBody,
    ApiDataset,
    ApiDatasetVersion,
)
from kagglesdk.datasets.types.dataset_types import DatasetInfo, SettingsLicense

from .errors import ApiError
from .files import link_or_copy
from .rules import SLUG_RE, Settings, check_access, check_owner, split_ref
from .sdk import message, utc
from .store import Store
from .uploads import Uploads


def live_versions(ds: dict) -> list[dict]:
    """The versions not deleted (by `delete_old_versions`), oldest first."""
    return [v for v in ds["versions"] if not v.get("deleted")]


def is_ready(version: dict) -> bool:
    return version["ready_at"] <= time.time()


class Datasets:
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

    def create(self, user: str, req: ApiCreateDatasetRequest) -> ApiCreateDatasetResponse:
        owner, slug = req.owner_slug or user, req.slug
        if not SLUG_RE.match(slug or "-"):
            raise ApiError(400, f"Invalid dataset slug {slug!r}")
        if owner != user:
            raise ApiError(403, f"Permission denied: cannot create a dataset owned by {owner!r} as {user!r}")
        ref = f"{owner}/{slug}"
        with self.store.lock:
            existing = self.store.state["datasets"].get(ref)
            if existing is not None and not existing.get("deleted"):
                return message(ApiCreateDatasetResponse, status="error",
                               error=f"The dataset '{ref}' already exists; push a new version")
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
        return created_reply(ref)

    def create_version(self, user: str, ref: str | None, body: ApiCreateDatasetVersionRequestBody | None,
                       dataset_id: int | None = None) -> ApiCreateDatasetResponse:
        """A new version of the dataset `ref` (owner/slug), or of the one with `dataset_id`."""
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
        return created_reply(ds["ref"])

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


def created_reply(ref: str) -> ApiCreateDatasetResponse:
    """What CreateDataset(Version) answers when it accepted the upload."""
    return message(ApiCreateDatasetResponse, ref=ref, url=f"http://localhost/datasets/{ref}", status="Ok")


def _described(ds: dict) -> dict:
    """The fields that `ApiDataset` and `DatasetInfo` both name alike."""
    return {"title": ds["title"], "subtitle": ds.get("subtitle"), "description": ds.get("description"),
            "is_private": ds["is_private"]}


def dataset_info(ds: dict) -> DatasetInfo:
    """The kagglesdk message of a dataset's metadata (GetDatasetMetadata)."""
    return message(DatasetInfo, dataset_id=ds["id"], dataset_slug=ds["slug"], owner_user=ds["owner"],
                   licenses=[message(SettingsLicense, name=ds["license"])], **_described(ds))


def dataset_reply(ds: dict, live: list[dict] | None = None) -> ApiDataset:
    """The kagglesdk message describing a dataset and its live versions (default: all of them; the newest is the
    current version)."""
    live = live_versions(ds) if live is None else live
    current = live[-1] if live else None
    return message(
        ApiDataset,
        id=ds["id"],
        ref=ds["ref"],
        **_described(ds),
        owner_name=ds["owner"],
        owner_ref=ds["owner"],
        creator_name=ds["owner"],
        license_name=ds["license"],
        url=f"http://localhost/datasets/{ds['ref']}",
        last_updated=utc(ds.get("updated", ds["created"])),
        total_bytes=sum(f["size"] for f in current["files"]) if current else 0,
        current_version_number=current["number"] if current else None,
        versions=[
            message(
                ApiDatasetVersion,
                version_number=v["number"],
                creation_date=utc(v["created"]),
                version_notes=v.get("notes"),
                creator_name=v.get("creator"),
                # A free-form string in kagglesdk; what Kaggle puts there is not known.
                status="ready" if is_ready(v) else "pending",
            )
            for v in live
        ],
    )
