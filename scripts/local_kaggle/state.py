"""The server's state, all of it on disk under its root, so a restarted server keeps it.

Here: `Store`, the one JSON document of datasets, kernels and their versions, and uploads (<root>/state.json), its
lock, ids and folders, and its recovery after a restart; `Accounts`, the users, their keys and the secrets attached
to each notebook (users.json, secrets.json, mode 0600, read on every call so they can be edited while the server
runs) and the operator's admin token; `Quota`, the weekly accelerator hours counted from the state; and the atomic
JSON writes they all use. On Kaggle a secret is attached to one notebook, in its page's Add-ons > Secrets, and only
once the notebook exists (no API call attaches one: docs/kaggle-tpu.md); so here secrets are kept per notebook too.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .rules import SLUG_RE, WEEK_S, ApiError, utc, week_start


def atomic_write_json(path: Path, data: Any, mode: int | None = None) -> None:
    """Write through a temporary file and rename, so a crash leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        if mode is not None:
            os.chmod(tmp, mode)  # before any byte is written: secrets are never readable by others
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path, default: Any) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return default


LOST_SESSION = "The local Kaggle server stopped while this session was running"


class Store:
    """All state is one JSON document, rewritten atomically on every change, so a restarted server keeps it.
    `lock` (re-entrant) guards `state`; hold it across a read-modify-`save`."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("blobs", "datasets", "kernels", "zips"):
            (self.root / sub).mkdir(exist_ok=True)
        self.lock = threading.RLock()
        self.path = self.root / "state.json"
        self.state = read_json(self.path, {"format": 1, "next_id": 1, "datasets": {}, "kernels": {}, "uploads": {}})

    def save(self) -> None:
        with self.lock:
            atomic_write_json(self.path, self.state)

    def next_id(self) -> int:
        """Ids of datasets, kernels and sessions share one counter, as distinct numbers are all the client needs."""
        n = self.state["next_id"]
        self.state["next_id"] = n + 1
        return n

    def kernel_dir(self, kernel: dict, number: int) -> Path:
        return self.root / "kernels" / kernel["owner"] / kernel["slug"] / str(number)

    def dataset_dir(self, ds: dict, number: int) -> Path:
        return self.root / "datasets" / ds["owner"] / ds["slug"] / str(number)

    def recover(self) -> None:
        """After a restart: sessions that were running are lost; queued ones run; half-written versions go."""
        changed = False
        for kernel in self.state["kernels"].values():
            for v in kernel["versions"]:
                if "session_id" not in v:  # state written before versions had one
                    v["session_id"] = self.next_id()
                    changed = True
                if v["status"] == "RUNNING":
                    v["status"] = "ERROR"
                    v["failure_message"] = LOST_SESSION
                    v["ended"] = v.get("ended") or time.time()
                    v["outputs_saved"] = False
                    changed = True
                elif v["status"] == "QUEUED":
                    v["queued_at"] = time.time()
        for tmp in (self.root / "datasets").glob("*/*/.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        if changed:
            self.save()


# What a session's own access token may not do while `Settings.notebook_token_writes` is off: every call this server
# has that writes a dataset (StartBlobUpload too: the first of any upload; UpdateDatasetMetadata: a session's proof).
NOTEBOOK_TOKEN_WRITES = ("StartBlobUpload", "CreateDataset", "CreateDatasetVersion", "CreateDatasetVersionById",
                         "DeleteDataset", "UpdateDatasetMetadata")
# The scope kaggle's own login asks for, "all ApiV1 endpoints" (kaggle 2.2.4 kaggle_api_extended.py L1603-1604): what
# a session's token carries by default (`Settings.notebook_token_scope`). Which scope a write needs is not verified,
# so a scope is only what IntrospectToken says: whether a token writes is `notebook_token_writes` alone.
FULL_SCOPE = "resources.admin:*"
API_TOKEN_PREFIX = "KGAT_"  # how a new-style API token begins (one the user makes on the settings page)


@dataclass
class NotebookToken:
    """A running session's own access token: whose it is, its scope, and when it stops working (None: when the
    session ends)."""

    owner: str
    scope: str = FULL_SCOPE
    expires: float | None = None

    def expired(self, now: float | None = None) -> bool:
        return self.expires is not None and (time.time() if now is None else now) >= self.expires


class Accounts:
    """Users and their API keys, the secrets attached to each notebook, the access token of each running session
    (a notebook token, as a Kaggle notebook has one), and the operator's admin token."""

    def __init__(self, root: Path, lock: threading.RLock, token_writes: Callable[[], bool] = lambda: True,
                 token_terms: Callable[[], tuple[float | str | None, str]] = lambda: (None, FULL_SCOPE)):
        self.lock = lock
        self.token_writes = token_writes  # whether a notebook token may write datasets and models
        self.token_terms = token_terms  # (lifetime in seconds or None, scope) of the notebook tokens issued next
        self.notebook_tokens: dict[str, NotebookToken] = {}  # a running session's token -> what it is
        self.users_path = root / "users.json"
        self.api_tokens_path = root / "api_tokens.json"  # {token: user}: new-style API tokens, sent as bearer
        self.secrets_path = root / "secrets.json"
        admin_path = root / "admin_token"
        if not admin_path.exists():
            admin_path.write_text(secrets.token_hex(16))
            os.chmod(admin_path, 0o600)
        self.admin_token = admin_path.read_text().strip()

    def users(self) -> dict[str, str]:
        return read_json(self.users_path, {})

    def add_user(self, name: str, key: str) -> None:
        if not SLUG_RE.match(name):
            raise ValueError(f"bad user name {name!r}")
        with self.lock:
            users = self.users()
            users[name] = key
            atomic_write_json(self.users_path, users, mode=0o600)

    def api_tokens(self) -> dict[str, str]:
        return read_json(self.api_tokens_path, {})

    def add_api_token(self, name: str, token: str | None = None) -> str:
        """A new-style API token for user `name` (KGAT_..., made here unless given), as Kaggle's settings page makes
        one: sent as a bearer token, never as basic auth; -> the token."""
        token = token or API_TOKEN_PREFIX + secrets.token_hex(16)
        if not token.startswith(API_TOKEN_PREFIX):
            raise ValueError(f"an API token begins with {API_TOKEN_PREFIX}")
        with self.lock:
            if name not in self.users():
                raise ValueError(f"unknown user {name!r}")
            tokens = self.api_tokens()
            tokens[token] = name
            atomic_write_json(self.api_tokens_path, tokens, mode=0o600)
        return token

    def attach_secret(self, kernel_ref: str, name: str, value: str) -> None:
        with self.lock:
            store = read_json(self.secrets_path, {})
            store.setdefault(kernel_ref, {})[name] = value
            atomic_write_json(self.secrets_path, store, mode=0o600)

    def secrets_of(self, kernel_ref: str) -> dict[str, str]:
        """The secrets attached to the notebook `owner/slug` (none until some are attached)."""
        return read_json(self.secrets_path, {}).get(kernel_ref, {})

    def issue_notebook_token(self, user: str, session_end: float | None = None) -> str:
        """A new access token for a session of `user`'s notebook, valid until revoked (when the session ends) or,
        with a lifetime (`token_terms`: seconds, or "session": until `session_end`, the session's own start plus its
        time limit), until that has passed: then refused (401), as an expired token is."""
        token = "nb-" + secrets.token_hex(16)
        lifetime, scope = self.token_terms()
        if lifetime == "session":
            expires = session_end
        else:
            expires = None if lifetime is None else time.time() + float(lifetime)
        with self.lock:
            self.notebook_tokens[token] = NotebookToken(user, scope, expires)
        return token

    def expire_notebook_tokens(self) -> None:
        """Every running session's token stops working now, as one whose lifetime ran out mid-session."""
        now = time.time()
        with self.lock:
            for token in self.notebook_tokens.values():
                token.expires = now if token.expires is None else min(token.expires, now)

    def introspect(self, token: str, user: str) -> dict:
        """What IntrospectToken answers of `token` (asked by `user`): a running session's token, its owner, scope
        and expiry (`active` false once expired); some user's key, that user; anything else, not active."""
        with self.lock:
            found = self.notebook_tokens.get(token)
        if found is not None:
            exp = None if found.expires is None else int(found.expires)
            return {"active": not found.expired(), "username": found.owner, "scope": found.scope, "exp": exp}
        name = next((n for n, key in self.users().items() if secrets.compare_digest(key, token)), None)
        name = name or self._api_token_user(token)
        return {"active": name is not None, "username": name or ""}

    def _api_token_user(self, token: str) -> str | None:
        return next((n for t, n in self.api_tokens().items() if secrets.compare_digest(t, token)), None)

    def revoke_notebook_token(self, token: str) -> None:
        with self.lock:
            self.notebook_tokens.pop(token, None)

    def authorize(self, header: str | None, method: str) -> None:
        """403 for a dataset write with a session's own token while such tokens may not write
        (`notebook_token_writes`). Its scope refuses nothing: which scope a write needs is not verified."""
        scheme, _, value = (header or "").partition(" ")
        with self.lock:
            token = self.notebook_tokens.get(value) if scheme.lower() == "bearer" else None
        if token is None or method not in NOTEBOOK_TOKEN_WRITES:
            return
        if not self.token_writes():
            raise ApiError(403, f"This notebook's access token may not call {method}: use an API key")

    def authenticate(self, header: str | None) -> str:
        """The user an Authorization header names: basic auth (name:key, a legacy key), or a bearer token that is a
        new-style API token, some key, or a running session's notebook token. An API token sent as basic auth is
        refused (401), as the kaggle client sends KAGGLE_KEY whatever it holds."""
        users = self.users()
        if not header:
            raise ApiError(401, "Missing credentials: set KAGGLE_USERNAME and KAGGLE_KEY (or KAGGLE_API_TOKEN)")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic":
            try:
                name, _, key = base64.b64decode(value).decode().partition(":")
            except Exception as err:
                raise ApiError(401, "Malformed basic auth header") from err
            if key.startswith(API_TOKEN_PREFIX):
                raise ApiError(401, "An API token is not a key: send it as a bearer token (KAGGLE_API_TOKEN)")
            if name not in users:
                raise ApiError(401, f"Unknown user {name!r}")
            if not secrets.compare_digest(users[name], key):
                raise ApiError(401, f"Wrong API key for user {name!r}")
            return name
        if scheme.lower() == "bearer":
            with self.lock:
                token = self.notebook_tokens.get(value)
            if token is not None and not token.expired():
                return token.owner
            name = self._api_token_user(value) or next(
                (n for n, key in users.items() if secrets.compare_digest(key, value)), None)
            if name is not None:
                return name
            raise ApiError(401, "Invalid or expired access token")
        raise ApiError(401, f"Unsupported authorization scheme {scheme!r}")


class Quota:
    """Weekly accelerator quota: hours used per user and kind (TPU, GPU), counted from the sessions' start and end
    times in the state, and what is refused or stopped when it runs out."""

    def __init__(self, store: Store, tpu_hours: float, gpu_hours: float):
        self.store = store
        self.allowed_s = {"tpu": tpu_hours * 3600.0, "gpu": gpu_hours * 3600.0}

    def has_run(self, user: str, kind: str) -> bool:
        """Whether the user ever ran a session on `kind`."""
        return bool(self._versions(user, kind))

    def _versions(self, user: str, kind: str) -> list[dict]:
        """The user's versions that ran (or run) on `kind`."""
        with self.store.lock:
            return [v for k in self.store.state["kernels"].values() if k["owner"] == user for v in k["versions"]
                    if v.get("accelerator") == kind and v.get("started") is not None]

    def used_s(self, user: str, kind: str, now: float | None = None) -> float:
        """Seconds used this week, never more than the allowance: Kaggle stops a session when the quota runs
        out, so the moment the watchdog notices it a little later is not charged."""
        now = time.time() if now is None else now
        start = week_start(now)
        used = sum(max(0.0, min(v.get("ended") or now, now) - max(v["started"], start))
                   for v in self._versions(user, kind))
        return min(used, self.allowed_s[kind])

    def push_refusal(self, user: str, kind: str) -> str | None:
        """Why a push on `kind` is refused (Kaggle answers in the push reply's `error`), or None."""
        used = self.used_s(user, kind)
        if used < self.allowed_s[kind]:
            return None
        reset = utc(week_start(time.time()) + WEEK_S)
        return (f"Your weekly {kind.upper()} quota of {self.allowed_s[kind] / 3600:g} hours is used up "
                f"({used / 3600:.2f} h); it resets at {reset.isoformat(timespec='milliseconds')}Z")

    def stop_reason(self, user: str, kind: str, now: float) -> str | None:
        """Why a running session on `kind` is stopped, or None."""
        if self.used_s(user, kind, now) < self.allowed_s[kind]:
            return None
        return f"Weekly {kind.upper()} quota of {self.allowed_s[kind] / 3600:g} hours used up; the session was stopped"
