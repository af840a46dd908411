"""HTTP/1.1 plumbing for the server's handler: request bodies (sized or chunked, read once), JSON and error
replies, and files sent with Range/If-Range resume, as the kaggle client's downloads use."""

from __future__ import annotations

import email.utils
import json
import re
import shutil
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

from .errors import ApiError


def http_date(ts: float) -> str:
    return email.utils.formatdate(ts, usegmt=True)


class HttpIO(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a request's body must be read whole before the next one
    server_version = "LocalKaggle/1.0"
    _body_read = False  # set per request once its body is (being) read

    def _iter_chunked(self) -> Iterator[bytes]:
        while True:
            line = self.rfile.readline()
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return
            data = self.rfile.read(size)
            self.rfile.readline()
            yield data

    def _iter_body(self, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The request body in pieces; once it has begun, the body counts as read (see `_drain`)."""
        self._body_read = True
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            yield from self._iter_chunked()
            return
        remaining = int(self.headers.get("Content-Length") or 0)
        while remaining > 0:
            data = self.rfile.read(min(chunk, remaining))
            if not data:
                break
            remaining -= len(data)
            yield data

    def _read_body(self) -> bytes:
        return b"".join(self._iter_body())

    def _drain(self) -> None:
        """Read an unread request body so the connection can be reused."""
        if not self._body_read:
            try:
                for _ in self._iter_body():
                    pass
            except Exception:
                self.close_connection = True

    def _send(self, status: int, body: bytes = b"", ctype: str = "application/json",
              headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers)

    def _send_error(self, err: ApiError) -> None:
        """Kaggle's error shape, `{"code", "message"}`, which the client raises as HTTPError; 3xx: a redirect."""
        if err.status in (301, 302, 303, 307, 308):
            self._send(err.status, b"", ctype="text/plain", headers=err.headers)
            return
        self._send_json(err.status, {"code": err.status, "message": err.message}, headers=err.headers)

    def _send_file(self, path: Path) -> None:
        st = path.stat()
        size = st.st_size
        etag = f'"{st.st_ino:x}-{size:x}-{int(st.st_mtime_ns):x}"'
        start = 0
        status = 200
        rng = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        m = re.match(r"bytes=(\d+)-$", rng or "")
        if m and (if_range is None or if_range in (etag, http_date(st.st_mtime))):
            start = int(m.group(1))
            if start >= size:
                raise ApiError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", http_date(st.st_mtime))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(path, "rb") as f:
            f.seek(start)
            shutil.copyfileobj(f, self.wfile, 1 << 20)
