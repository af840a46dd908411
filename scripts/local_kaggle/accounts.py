"""Users, their API keys, the secrets attached to each notebook, and the operator's admin token. Users and secrets
are files under the root (users.json, secrets.json, mode 0600), read on every call so they can be edited while the
server runs. On Kaggle a secret is attached to one notebook, in its page's Add-ons > Secrets, and only once the
notebook exists (no API call attaches one: docs/kaggle-tpu.md); so here secrets are kept per notebook too."""

from __future__ import annotations

import base64
import os
import secrets
import threading
from pathlib import Path

from .errors import ApiError
from .files import atomic_write_json, read_json
from .rules import SLUG_RE


class Accounts:
    def __init__(self, root: Path, lock: threading.RLock):
        self.lock = lock
        self.users_path = root / "users.json"
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

    def attach_secret(self, kernel_ref: str, name: str, value: str) -> None:
        with self.lock:
            store = read_json(self.secrets_path, {})
            store.setdefault(kernel_ref, {})[name] = value
            atomic_write_json(self.secrets_path, store, mode=0o600)

    def secrets_of(self, kernel_ref: str) -> dict[str, str]:
        """The secrets attached to the notebook `owner/slug` (none until some are attached)."""
        return read_json(self.secrets_path, {}).get(kernel_ref, {})

    def authenticate(self, header: str | None) -> str:
        """The user an Authorization header names: basic auth (name:key), or a bearer token that is some key."""
        users = self.users()
        if not header:
            raise ApiError(401, "Missing credentials: set KAGGLE_USERNAME and KAGGLE_KEY (or KAGGLE_API_TOKEN)")
        scheme, _, value = header.partition(" ")
        if scheme.lower() == "basic":
            try:
                name, _, key = base64.b64decode(value).decode().partition(":")
            except Exception as err:
                raise ApiError(401, "Malformed basic auth header") from err
            if name not in users:
                raise ApiError(401, f"Unknown user {name!r}")
            if not secrets.compare_digest(users[name], key):
                raise ApiError(401, f"Wrong API key for user {name!r}")
            return name
        if scheme.lower() == "bearer":
            for name, key in users.items():
                if secrets.compare_digest(key, value):
                    return name
            raise ApiError(401, "Invalid or expired access token")
        raise ApiError(401, f"Unsupported authorization scheme {scheme!r}")
