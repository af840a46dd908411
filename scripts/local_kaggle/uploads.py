"""Blob uploads, as the client makes them for dataset files: StartBlobUpload gives a token and a URL on this
server, then the file goes up in a resumable PUT (as against Google Cloud Storage). A dataset version takes the
uploaded files by token."""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from kagglesdk.blobs.types.blob_api_service import ApiStartBlobUploadRequest, ApiStartBlobUploadResponse
from kagglesdk.datasets.types.dataset_api_service import ApiDatasetNewFile

from .errors import ApiError
from .sdk import message
from .store import Store

STATUS_QUERY = re.compile(r"bytes \*/\d+$")  # Content-Range of a resumable upload asking how far it got


def _received_range(received: int) -> dict[str, str]:
    """The `Range` header of a 308 reply: the bytes received so far (none: no header)."""
    return {"Range": f"bytes=0-{received - 1}"} if received else {}


class Uploads:
    def __init__(self, store: Store):
        self.store = store

    def path(self, token: str) -> Path:
        return self.store.root / "blobs" / token

    def start(self, user: str, req: ApiStartBlobUploadRequest) -> ApiStartBlobUploadResponse:
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
            }
            self.path(token).touch()
            self.store.save()
        return message(ApiStartBlobUploadResponse, token=token, create_url=f"http://localhost/_upload/{token}")

    def receive(self, token: str, content_range: str, body: Iterable[bytes]) -> tuple[int, dict, dict | None]:
        """One PUT to the upload URL: (HTTP status, headers, JSON reply or None for an empty one). `body` is read
        only when bytes are written, so a status query (`Content-Range: bytes */N`) leaves it unread."""
        with self.store.lock:
            up = self.store.state["uploads"].get(token)
            if up is None:
                raise ApiError(404, f"Unknown upload {token!r}")
            up = dict(up)
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
