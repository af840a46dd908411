"""Injected failures for tests: HTTP errors on chosen calls, a session that fails to start, a kill at a moment, a
status call that still describes the previous version."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import ApiError


class Faults:
    """Injected failures. HTTP faults match a method name ("SaveKernel"), "Service/Method", "upload",
    "download" or "*"; session faults match a kernel ref or "*"."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.http: list[dict] = []
        self.session_errors: list[dict] = []
        self.kills: list[dict] = []
        self.stale_statuses: list[dict] = []

    def add(self, fault: dict) -> None:
        kind = fault.get("kind", "http")
        fault = dict(fault)
        fault.setdefault("count", 1)
        with self.lock:
            if kind == "http":
                if "match" not in fault or "status" not in fault:
                    raise ApiError(400, "an http fault needs match and status")
                self.http.append(fault)
            elif kind == "session_error":
                fault.setdefault("kernel", "*")
                fault.setdefault("message", "Injected fault: the session failed to start")
                self.session_errors.append(fault)
            elif kind == "kill":
                fault.setdefault("kernel", "*")
                fault.setdefault("message", "Injected fault: the session was killed")
                if fault.get("after_s") is None and not fault.get("on_log"):
                    raise ApiError(400, "a kill fault needs after_s or on_log")
                self.kills.append(fault)
            elif kind == "stale_status":  # an unlabelled status call answers for the version before the newest
                fault.setdefault("kernel", "*")
                self.stale_statuses.append(fault)
            else:
                raise ApiError(400, f"unknown fault kind {kind!r}")

    def clear(self) -> None:
        with self.lock:
            self.http.clear()
            self.session_errors.clear()
            self.kills.clear()
            self.stale_statuses.clear()

    @staticmethod
    def _take(items: list[dict], pred: Callable[[dict], bool]) -> dict | None:
        for item in items:
            if pred(item):
                item["count"] -= 1
                if item["count"] <= 0:
                    items.remove(item)
                return item
        return None

    def take_http(self, names: set[str]) -> dict | None:
        with self.lock:
            return self._take(self.http, lambda f: f["match"] == "*" or f["match"] in names)

    def take_session_error(self, ref: str) -> dict | None:
        with self.lock:
            return self._take(self.session_errors, lambda f: f["kernel"] in ("*", ref))

    def take_kill(self, ref: str) -> dict | None:
        with self.lock:
            return self._take(self.kills, lambda f: f["kernel"] in ("*", ref))

    def status_version(self, kernel: dict) -> dict:
        """The version an unlabelled status call describes: the newest, or (a stale_status fault) the one before."""
        versions = kernel["versions"]
        if len(versions) > 1:
            with self.lock:
                if self._take(self.stale_statuses, lambda f: f["kernel"] in ("*", kernel["ref"])):
                    return versions[-2]
        return versions[-1]
