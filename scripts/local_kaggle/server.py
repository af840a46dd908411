"""The HTTP side: the request handler (the API under /api/v1/<service>/<Method>, blob uploads and downloads, live
logs, the admin endpoint; every other host refused, as there is no internet), and the client-side helpers that
point HTTP at this server or call its admin endpoint."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import sys
import time
import traceback
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ApiError
from .http_io import HttpIO
from .routes import call_api
from .rules import TERMINAL

if TYPE_CHECKING:
    from .app import LocalKaggle

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


def admin_action(app: LocalKaggle, action: str, req: dict) -> dict:
    """What an operator (or a test driving a server in another process) can do: faults, kills, users, secrets."""
    if action == "fault":
        app.faults.add(req)
    elif action == "clear-faults":
        app.faults.clear()
    elif action == "kill":
        if not app.kill_session(req["kernel"], req.get("message") or "Killed by the local Kaggle operator"):
            raise ApiError(404, f"Kernel {req['kernel']!r} has no running session")
    elif action == "user":
        app.add_user(req["name"], req["key"])
    elif action == "secret":
        app.attach_secret(req["kernel"], req["name"], req["value"])
    elif action == "quota":
        return {k: app.quota_used_s(req["user"], k) for k in ("tpu", "gpu")}
    else:
        raise ApiError(404, f"Unknown admin action {action!r}")
    return {"ok": True}


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


class Handler(HttpIO):
    app: LocalKaggle  # set on the subclass `LocalKaggle.start` makes

    def log_message(self, fmt: str, *args) -> None:
        if self.app.verbose:
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
            if self.app.verbose:
                traceback.print_exc()

    def _fault(self, names: set[str]) -> None:
        """Raise an injected HTTP fault that matches one of `names`, if any is left."""
        fault = self.app.faults.take_http(names)
        if fault is not None:
            headers = {}
            if fault.get("retry_after") is not None:
                headers["Retry-After"] = str(fault["retry_after"])
            raise ApiError(int(fault["status"]), fault.get("message") or f"Injected HTTP {fault['status']}", headers)

    def _route(self, path: str, query: dict) -> None:
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/")]
        app = self.app
        if parts[:2] == ["api", "v1"] and self.command == "POST" and len(parts) == 4:
            service, method = parts[2], parts[3]
            body = self._read_body()
            self._fault({method, f"{service}/{method}", "api"})
            user = app.accounts.authenticate(self.headers.get("Authorization"))
            try:
                req = json.loads(body or b"{}")
            except ValueError:
                raise ApiError(400, "The request body is not JSON") from None
            self._send_json(200, call_api(app, user, service, method, req))
        elif parts[:5] == ["api", "v1", "kernels", "logs", "stream"] and len(parts) == 7:
            self._fault({"GetKernelSessionLogsStream", "logs", "api"})
            user = app.accounts.authenticate(self.headers.get("Authorization"))
            self._stream_logs(user, f"{parts[5]}/{parts[6]}")
        elif parts[0] == "_upload" and len(parts) == 2 and self.command == "PUT":
            self._fault({"upload", "blob"})
            self._upload(parts[1])
        elif parts[0] == "_blobs" and self.command in ("GET", "HEAD"):
            self._fault({"download", "blob"})
            self._serve_blob(parts[1:], query)
        elif parts[0] == "_admin":
            self._admin(parts[1:])
        else:
            raise ApiError(404, f"The local Kaggle has nothing at {self.command} {path}")

    def _upload(self, token: str) -> None:
        status, headers, reply = self.app.uploads.receive(token, self.headers.get("Content-Range", ""),
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
            base = self.app.kernels.output_dir(ref, number)
            path = base / rel
        elif kind == "dataset" and "zip" in query:
            path = self.app.datasets.zip_file(ref, number)
            base = path.parent
        elif kind == "dataset":
            base = self.app.datasets.version_dir(ref, number)
            path = base / rel
        else:
            raise ApiError(404, "No such blob")
        path = path.resolve()
        if base.resolve() not in path.parents or not path.is_file():
            raise ApiError(404, f"No such file {rel!r}")
        self._send_file(path)

    def _stream_logs(self, user: str, ref: str) -> None:
        """`kaggle kernels logs --follow`: server-sent events while the version runs, a JSON array once ended."""
        app = self.app
        self._drain()
        with app.store.lock:
            kernel = app.kernels.visible(user, ref)
            v = kernel["versions"][-1]
            number, running = v["number"], v["status"] not in TERMINAL
        if not running:
            body = json.dumps(app.kernels.log_events(kernel, number)).encode()
            self._send(200, body, ctype="application/octet-stream")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        sent = 0
        while True:
            with app.store.lock:
                finished = v["status"] in TERMINAL
            events = app.kernels.log_events(kernel, number)
            for event in events[sent:]:
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            sent = len(events)
            self.wfile.flush()
            if finished:
                break
            time.sleep(0.2)
        self.wfile.write(b"data: END_OF_LOG\n\n")
        self.wfile.flush()

    def _admin(self, parts: list[str]) -> None:
        body = self._read_body()
        if not secrets.compare_digest(self.headers.get(ADMIN_HEADER, ""), self.app.accounts.admin_token):
            raise ApiError(403, f"admin calls need the {ADMIN_HEADER} header from <root>/admin_token")
        self._send_json(200, admin_action(self.app, parts[0] if parts else "", json.loads(body or b"{}")))
