"""A local Hugging Face Hub that the real `huggingface_hub` and `datasets` read through `HF_ENDPOINT`, with faults
injected on request: the tokenize kernel's stream is tested (and benchmarked) against it as against the real Hub.

It serves dataset repos from a folder (`ROOT/<org>/<name>/...`, one commit whose sha is a hash of the files) and
answers the calls a streaming `load_dataset` makes, in the shapes huggingface_hub 2.4.0 reads (docs/tokenize.md
cites each): dataset info (`/api/datasets/<id>[/revision/<rev>]`), the tree (`/api/datasets/<id>/tree/<rev>/<path>`,
`recursive`), paths-info (POST), and `/datasets/<id>/resolve/<rev>/<path>` with HEAD and HTTP Range.

    python -m scripts.local_hub --root build/hub --build-demo   # serve a FineWeb-Edu-shaped repo of the demo corpus
    HF_ENDPOINT=http://127.0.0.1:PORT python kernels/tokenize.py --out-dir data/hub-part0 ...

Faults (`LocalHub.add_fault`), each on the next `count` requests whose path holds `match`: `429` (Retry-After and
RateLimit headers), `503`, `reset` (the connection dropped after `after_bytes` of the body), `stall` (the body
stops for `stall_s` seconds), `slow` (the body at `bytes_per_s`), `silence` (any request, API calls included: the
connection is accepted and nothing is sent for `stall_s` seconds, then it is dropped, as a half-open link or a
proxy that never answers). Every request and fault served is recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import socket
import struct
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path

from scripts.local_kaggle.server import HttpIO

FAULT_KINDS = ("429", "503", "reset", "stall", "slow", "silence")
FINEWEB_README = """---
license: odc-by
configs:
- config_name: sample-10BT
  data_files:
  - split: train
    path: sample/10BT/*
---
# A local stand-in for FineWeb-Edu's sample-10BT layout
"""


@dataclass
class Fault:
    kind: str
    match: str = ".parquet"
    count: int = 1
    after_bytes: int = 0  # reset/stall: body bytes sent first
    retry_after: int = 1  # 429/503: seconds the client is told to wait (Retry-After)
    stall_s: float = 30.0
    bytes_per_s: int = 1_000_000
    served: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r}: expected one of {', '.join(FAULT_KINDS)}")


@dataclass
class _Repo:
    root: Path
    sha: str
    files: dict[str, Path] = field(default_factory=dict)  # path in repo -> file
    entries: dict[str, dict] = field(default_factory=dict)  # path in repo -> its tree entry (hashed once)


def _git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _load_repo(folder: Path) -> _Repo:
    files = {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}
    entries = {name: _file_entry(name, path.read_bytes()) for name, path in files.items()}
    digest = hashlib.sha1()
    for name, entry in entries.items():
        digest.update(f"{name}\0{entry['oid']}\0".encode())
    return _Repo(folder, digest.hexdigest(), files, entries)


class LocalHub:
    """The server, run on a thread: `with LocalHub(root) as hub: ... hub.url ...`."""

    def __init__(self, root: str | Path, port: int = 0, token: str = "") -> None:
        self.root = Path(root)
        self.token = token  # when set, every request must carry it (a gated or private repo)
        self.repos = {f"{o.name}/{r.name}": _load_repo(r) for o in sorted(self.root.iterdir()) if o.is_dir()
                      for r in sorted(o.iterdir()) if r.is_dir()}
        self.faults: list[Fault] = []
        self.log: list[dict] = []  # one entry per request: method, path, status, fault
        self._lock = threading.Lock()
        self.stopping = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _make_handler(self))
        self.server.daemon_threads = True  # a stalled reply must not hold up the shutdown
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def sha(self, repo_id: str) -> str:
        return self.repos[repo_id].sha

    def add_fault(self, kind: str, **kw) -> Fault:
        fault = Fault(kind, **kw)
        with self._lock:
            self.faults.append(fault)
        return fault

    def take_fault(self, path: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.served < fault.count and fault.match in path:
                    fault.served += 1
                    return fault
        return None

    def record(self, **entry) -> None:
        with self._lock:
            self.log.append(entry)

    def faults_served(self) -> dict[str, int]:
        with self._lock:
            return {kind: sum(f.served for f in self.faults if f.kind == kind) for kind in FAULT_KINDS}

    def start(self) -> LocalHub:
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _file_entry(path: str, data: bytes) -> dict:
    """A file's tree / paths-info entry, as `RepoFile` reads it (path, size, oid, lfs)."""
    entry = {"type": "file", "path": path, "size": len(data), "oid": _git_blob_sha(data)}
    if path.endswith(".parquet"):  # large files live in LFS on the Hub: the sha256 is their ETag
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _folders(repo: _Repo) -> set[str]:
    return {"/".join(p.split("/")[:i]) for p in repo.files for i in range(1, p.count("/") + 1)}


def _tree(repo: _Repo, base: str, recursive: bool) -> list[dict] | None:
    prefix = base + "/" if base else ""
    folders = _folders(repo)
    if base and base not in folders:
        return None
    out = []
    for folder in sorted(folders):
        rest = folder[len(prefix):]
        if folder.startswith(prefix) and rest and (recursive or "/" not in rest):
            out.append({"type": "directory", "path": folder, "oid": hashlib.sha1(folder.encode()).hexdigest()})
    for path in repo.files:
        rest = path[len(prefix):]
        if path.startswith(prefix) and (recursive or "/" not in rest):
            out.append(repo.entries[path])
    return out


def _make_handler(hub: LocalHub):
    class Handler(HttpIO):  # the local Kaggle's HTTP/1.1 plumbing: request bodies, JSON replies
        def log_message(self, *args) -> None:  # the hub's own log has every request
            pass

        def do_HEAD(self) -> None:
            self._serve("HEAD")

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            url = urllib.parse.urlsplit(self.path)
            path = urllib.parse.unquote(url.path)
            self.body = self._read_body() if method == "POST" else b""
            if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                return self._error(method, path, 401, "Invalid credentials in Authorization header")
            fault = hub.take_fault(path) if method == "GET" else None
            if fault and fault.kind == "silence":
                hub.record(method=method, path=path, status=None, fault=fault.kind)
                return self._drop(fault.stall_s)
            if fault and fault.kind in ("429", "503"):
                hub.record(method=method, path=path, status=int(fault.kind), fault=fault.kind)
                headers = {"Retry-After": str(fault.retry_after)}
                if fault.kind == "429":
                    headers["RateLimit"] = f'"resolvers";r=0;t={fault.retry_after}'
                return self._json(method, int(fault.kind), {"error": f"injected {fault.kind}"}, headers, log=False)
            try:
                self._route(method, path, urllib.parse.parse_qs(url.query), fault)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def _route(self, method: str, path: str, query: dict, fault: Fault | None) -> None:
            m = re.fullmatch(r"/api/datasets/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(?:/(.*))?)?", path)
            if m:
                repo_id, what, rev, sub = m.groups()
                repo = self._repo(method, path, repo_id, rev)
                if repo is None:
                    return
                if what in (None, "revision"):
                    siblings = [{"rfilename": p} for p in repo.files]
                    return self._json(method, 200, {"id": repo_id, "_id": repo.sha[:24], "sha": repo.sha,
                                                    "private": False, "gated": False, "disabled": False,
                                                    "siblings": siblings, "tags": [], "downloads": 0,
                                                    "lastModified": "2025-01-01T00:00:00.000Z", "cardData": {}})
                if what == "tree":
                    recursive = query.get("recursive", ["false"])[0].lower() == "true"
                    items = _tree(repo, (sub or "").strip("/"), recursive)
                    if items is None:
                        return self._error(method, path, 404, f"{sub}: no such folder", "EntryNotFound")
                    return self._json(method, 200, items)
                form = urllib.parse.parse_qs(self.body.decode())
                asked = [p.strip("/") for p in form.get("paths", [])]
                folders = _folders(repo)
                found = [repo.entries[p] if p in repo.files else {"type": "directory", "path": p, "oid": "0" * 40}
                         for p in asked if p in repo.files or p in folders]
                return self._json(method, 200, found)
            m = re.fullmatch(r"/datasets/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                repo_id, rev, file_path = m.groups()
                repo = self._repo(method, path, repo_id, rev)
                if repo is None:
                    return
                if file_path not in repo.files:
                    return self._error(method, path, 404, f"{file_path}: entry not found", "EntryNotFound")
                return self._file(method, path, repo, file_path, fault)
            return self._error(method, path, 404, "not served by the local hub")

        def _repo(self, method: str, path: str, repo_id: str, rev: str | None) -> _Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(method, path, 404, f"Repository {repo_id} not found", "RepoNotFound")
                return None
            if rev not in (None, "main", repo.sha):
                self._error(method, path, 404, f"Invalid rev id: {rev}", "RevisionNotFound")
                return None
            return repo

        def _file(self, method: str, path: str, repo: _Repo, file_path: str, fault: Fault | None) -> None:
            data = repo.files[file_path].read_bytes()
            entry = repo.entries[file_path]
            etag = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
            start, end = 0, len(data)
            status = 200
            rng = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
            if rng:
                start = int(rng.group(1))
                end = min(len(data), int(rng.group(2)) + 1) if rng.group(2) else len(data)
                if start >= len(data):
                    return self._error(method, path, 416, "range not satisfiable")
                status = 206
            body = data[start:end]
            self.send_response(status)
            for name, value in {"Content-Type": "application/octet-stream", "Content-Length": str(len(body)),
                                "Accept-Ranges": "bytes", "ETag": f'"{etag}"', "X-Repo-Commit": repo.sha,
                                "Content-Range": f"bytes {start}-{end - 1}/{len(data)}" if rng else None}.items():
                if value is not None:
                    self.send_header(name, value)
            self.end_headers()
            hub.record(method=method, path=path, status=status, fault=fault.kind if fault else None,
                       range=self.headers.get("Range"))
            if method == "HEAD":
                return
            if fault is None:
                self.wfile.write(body)
            elif fault.kind == "slow":
                for i in range(0, len(body), max(1, fault.bytes_per_s // 10)):
                    self.wfile.write(body[i:i + max(1, fault.bytes_per_s // 10)])
                    self.wfile.flush()
                    time.sleep(0.1)
            else:  # reset or stall: part of the body, then a dropped connection or a long silence
                self.wfile.write(body[:fault.after_bytes])
                self.wfile.flush()
                self._drop(fault.stall_s if fault.kind == "stall" else 0.0)

        def _drop(self, silent_s: float) -> None:
            """Send nothing more for `silent_s` (cut short when the hub stops), then drop the connection."""
            if silent_s:
                hub.stopping.wait(silent_s)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            self.connection.close()  # with linger 0: a TCP reset, as a dropped link gives

        def _json(self, method: str, status: int, payload, headers: dict | None = None, log: bool = True) -> None:
            self._send_json(status, payload, headers)
            if log:
                hub.record(method=method, path=self.path, status=status, fault=None)

        def _error(self, method: str, path: str, status: int, message: str, code: str = "") -> None:
            self._json(method, status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message}
                       if code else {"X-Error-Message": message})

    return Handler


def build_fineweb_like(root: str | Path, docs: list[str], files: int = 3, row_group_rows: int = 200,
                       repo_id: str = "HuggingFaceFW/fineweb-edu") -> Path:
    """A dataset repo in FineWeb-Edu's layout (`sample/10BT/NNN_00000.parquet`, its columns, several row groups a
    file, a README whose `configs:` names sample-10BT) holding `docs` in order, split over `files` files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = Path(root) / repo_id
    (repo / "sample" / "10BT").mkdir(parents=True, exist_ok=True)
    (repo / "README.md").write_text(FINEWEB_README)
    cuts = [round(i * len(docs) / files) for i in range(files + 1)]
    for i in range(files):
        chunk = docs[cuts[i]:cuts[i + 1]]
        n = len(chunk)
        table = pa.table({
            "text": pa.array(chunk, pa.string()),
            "id": [f"<urn:uuid:{cuts[i] + j:08d}>" for j in range(n)],
            "dump": ["CC-MAIN-2024-10"] * n,
            "url": [f"https://example.org/{cuts[i] + j}" for j in range(n)],
            "file_path": ["s3://commoncrawl/crawl-data/local.warc.gz"] * n,
            "language": ["en"] * n,
            "language_score": pa.array([0.9] * n, pa.float64()),
            "token_count": pa.array([len(d) // 4 for d in chunk], pa.int64()),
            "score": pa.array([3.0] * n, pa.float64()),
            "int_score": pa.array([3] * n, pa.int64()),
        })
        pq.write_table(table, repo / "sample" / "10BT" / f"{i:03d}_00000.parquet", row_group_size=row_group_rows)
    return repo


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="build/hub", help="folder of <org>/<name>/ dataset repos")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--build-demo", action="store_true", help="first write FineWeb-Edu's layout from the demo "
                        "corpus (Python's documentation) under --root")
    args = parser.parse_args(argv)
    if args.build_demo:
        from shared.tokenize.demo_corpus import demo_documents

        build_fineweb_like(args.root, list(demo_documents()))
    with LocalHub(args.root, args.port) as hub:
        print(f"local hub at {hub.url} serving {', '.join(hub.repos)}; set HF_ENDPOINT={hub.url}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
