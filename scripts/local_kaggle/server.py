"""The HTTP side of the local Kaggle, and how a client reaches it.

Here: `make_server`, the server whose handler serves the API under /api/v1/<service>/<Method>, blob uploads and
downloads, live logs and the admin endpoint, and refuses every other host (there is no internet); `Backend`, the
callables it serves them from; the HTTP/1.1 plumbing (bodies, replies, Range downloads); and the client-side
helpers that point HTTP at this server (`proxy_env`) or call its admin endpoint (`admin_call`).
"""

from __future__ import annotations

import email.utils
import http.client
import json
import os
import re
import secrets
import shutil
import sys
import time
import traceback
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .rules import ApiError, is_read

LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1", ""}
ADMIN_HEADER = "X-Local-Kaggle-Admin"


def proxy_env(url: str) -> dict[str, str]:
    """Proxy variables that send every HTTP(S) request to `url`: an accidental https call fails fast here instead
    of hanging, and localhost must not bypass the proxy."""
    env = {}
    for name in ("HTTP_PROXY", "HTTPS_PROXY"):
        env[name] = env[name.lower()] = url
    env["NO_PROXY"] = env["no_proxy"] = ""
    return env


def admin_call(root: str | os.PathLike, port: int, action: str, payload: dict | None = None) -> dict:
    """Call a running server's admin endpoint directly (no proxy), e.g. admin_call(root, port, "fault", {...})."""
    token = (Path(root) / "admin_token").read_text().strip()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", f"/_admin/{action}", body=json.dumps(payload or {}),
                     headers={ADMIN_HEADER: token, "Content-Type": "application/json"})
        resp = conn.getresponse()
        data = json.loads(resp.read() or b"{}")
    finally:
        conn.close()
    if resp.status != 200:
        raise RuntimeError(f"admin {action}: HTTP {resp.status}: {data.get('message')}")
    return data


# ----- serving -----

@dataclass
class Backend:
    """What the handler serves requests from: the server's parts, as the few callables it uses."""

    verbose: bool
    admin_token: str
    authenticate: Callable[[str | None], str]  # an Authorization header -> the user; 401 otherwise
    authorize: Callable[[str | None, str], None]  # (Authorization header, API method): 403 where it may not
    take_http_fault: Callable[..., dict | None]  # an injected HTTP fault matching one of the names (after: served)
    call_api: Callable[[str, str, str, Any], dict]  # (user, service, method, request JSON) -> reply JSON
    receive_upload: Callable[[str, str, Iterable[bytes]], tuple[int, dict, dict | None]]  # (token, range, body)
    kernel_output_dir: Callable[[str, int], Path]  # (kernel ref, version) -> its saved /kaggle/working
    dataset_dir: Callable[[str, int], Path]  # (dataset ref, version) -> its files' folder
    dataset_zip: Callable[[str, int], Path]  # (dataset ref, version) -> the version as one zip
    kernel_log: Callable[[str, str, int | None], tuple[int, list[dict], bool]]  # (user, ref, version) -> log
    admin: Callable[[str, dict], dict]  # (action, request) -> reply of an admin call


def make_server(host: str, port: int, backend: Backend) -> ThreadingHTTPServer:
    """An HTTP server on (host, port) (port 0: a free one) serving from `backend`; not yet serving."""
    handler = type("Handler", (Handler,), {"backend": backend})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    return httpd


def http_date(ts: float) -> str:
    return email.utils.formatdate(ts, usegmt=True)


class HttpIO(BaseHTTPRequestHandler):
    """HTTP/1.1 plumbing: request bodies (sized or chunked, read once), JSON and error replies, and files sent with
    Range/If-Range resume, as the kaggle client's downloads use."""

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


class Handler(HttpIO):
    """Serves one connection's requests from `backend` (set on the subclass `make_server` makes)."""

    backend: Backend

    def log_message(self, fmt: str, *args) -> None:
        if self.backend.verbose:
            sys.stderr.write("local-kaggle: " + (fmt % args) + "\n")

    def do_POST(self) -> None:
        self._dispatch()

    do_GET = do_HEAD = do_PUT = do_DELETE = do_POST

    def do_CONNECT(self) -> None:
        self._send_json(502, {"code": 502, "message": (
            f"The local Kaggle has no internet: refused CONNECT {self.path}. Set KAGGLE_API_ENVIRONMENT=LOCALHOST "
            "before importing kaggle so the client calls http://localhost.")})
        self.close_connection = True

    def _dispatch(self) -> None:
        self._body_read = False
        try:
            url = urllib.parse.urlsplit(self.path)
            host = (url.hostname or "").lower()
            if url.scheme and host not in LOCAL_HOSTS:
                raise ApiError(502, f"The local Kaggle has no internet: refused {self.command} {self.path}")
            self._route(url.path, urllib.parse.parse_qs(url.query))
        except ApiError as err:
            self._drain()
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as err:
            self._drain()
            self._send_json(500, {"code": 500, "message": f"local Kaggle internal error: {err!r}"})
            if self.backend.verbose:
                traceback.print_exc()

    def _fault(self, names: set[str], after: bool = False) -> None:
        """Raise an injected HTTP fault that matches one of `names`, if any is left (`after`: one that answers once
        the call was served)."""
        fault = self.backend.take_http_fault(names, after)
        if fault is not None:
            headers = {}
            if fault.get("retry_after") is not None:
                headers["Retry-After"] = str(fault["retry_after"])
            raise ApiError(int(fault["status"]), fault.get("message") or f"Injected HTTP {fault['status']}", headers)

    def _route(self, path: str, query: dict) -> None:
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        backend = self.backend
        if parts[:2] == ["api", "v1"] and self.command == "POST" and len(parts) == 4:
            service, method = parts[2], parts[3]
            body = self._read_body()
            names = {method, f"{service}/{method}", "api"} | ({"read"} if is_read(method) else set())
            self._fault(names)
            user = backend.authenticate(self.headers.get("Authorization"))
            backend.authorize(self.headers.get("Authorization"), method)
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                raise ApiError(400, "The request body is not JSON") from None
            reply = backend.call_api(user, service, method, req)
            self._fault(names, after=True)
            self._send_json(200, reply)
        elif parts[:5] == ["api", "v1", "kernels", "logs", "stream"] and len(parts) == 7:
            self._fault({"GetKernelSessionLogsStream", "logs", "api", "read"})
            user = backend.authenticate(self.headers.get("Authorization"))
            self._stream_logs(user, f"{parts[5]}/{parts[6]}")
        elif parts[0] == "_upload" and len(parts) == 2 and self.command == "PUT":
            self._fault({"upload", "blob"})
            self._upload(parts[1])
        elif parts[0] == "_blobs" and self.command in ("GET", "HEAD"):
            self._fault({"download", "blob"})
            self._serve_blob(parts[1:], query)
        elif parts[0] == "_admin":
            self._admin(parts[1:])
        elif parts[0] == "kaggle-jwt-handler":  # kagglehub's attach in a notebook (KaggleJwtClient)
            raise ApiError(403, f"{parts[-1]}: attaching a datasource is refused in a batch session (the local "
                                "Kaggle models third-party reports; Kaggle's own answer is not verified)")
        else:
            raise ApiError(404, f"The local Kaggle has nothing at {self.command} {path}")

    def _upload(self, token: str) -> None:
        status, headers, reply = self.backend.receive_upload(token, self.headers.get("Content-Range", ""),
                                                             self._iter_body())
        self._drain()  # a status query sends a body the upload did not read
        if reply is None:
            self._send(status, b"", ctype="text/plain", headers=headers)
        else:
            self._send_json(status, reply, headers=headers)

    def _serve_blob(self, parts: list[str], query: dict) -> None:
        """/_blobs/kernel-output|dataset/<owner>/<slug>/<version>/<path>: the URLs the API replies name."""
        self._drain()
        if len(parts) < 5 or not parts[3].isdigit():
            raise ApiError(404, "No such blob")
        kind, ref, number, rel = parts[0], f"{parts[1]}/{parts[2]}", int(parts[3]), "/".join(parts[4:])
        if kind == "kernel-output":
            base = self.backend.kernel_output_dir(ref, number)
            path = base / rel
        elif kind == "dataset" and "zip" in query:
            path = self.backend.dataset_zip(ref, number)
            base = path.parent
        elif kind == "dataset":
            base = self.backend.dataset_dir(ref, number)
            path = base / rel
        else:
            raise ApiError(404, "No such blob")
        path = path.resolve()
        if base.resolve() not in path.parents or not path.is_file():
            raise ApiError(404, f"No such file {rel!r}")
        self._send_file(path)

    def _stream_logs(self, user: str, ref: str) -> None:
        """`kaggle kernels logs --follow`: server-sent events while the version runs, a JSON array once ended."""
        self._drain()
        number, events, ended = self.backend.kernel_log(user, ref, None)
        if ended:
            self._send(200, json.dumps(events).encode(), ctype="application/octet-stream")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent = 0
        while True:
            _, events, ended = self.backend.kernel_log(user, ref, number)
            for event in events[sent:]:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            sent = len(events)
            self.wfile.flush()
            if ended:
                break
            time.sleep(0.2)
        self.wfile.write(b"data: END_OF_LOG\n\n")
        self.wfile.flush()

    def _admin(self, parts: list[str]) -> None:
        body = self._read_body()
        if not secrets.compare_digest(self.headers.get(ADMIN_HEADER, ""), self.backend.admin_token):
            raise ApiError(403, f"admin calls need the {ADMIN_HEADER} header from <root>/admin_token")
        self._send_json(200, self.backend.admin(parts[0] if parts else "", json.loads(body or b"{}")))
