"""Injected failures for tests: HTTP errors on chosen calls, a session that fails to start, a kill at a moment, a
status call that still describes the previous version; for datasets, status and version calls that still describe
the previous version, a session that mounts the previous version, and a create that reports success but never
lands (as one over the private-dataset quota: kaggle-cli issue 284)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from .errors import ApiError


class Faults:
    """Injected failures. HTTP faults match a method name ("SaveKernel"), "Service/Method", "upload",
    "download" or "*"; session faults match a kernel ref or "*"; dataset faults a dataset ref or "*"."""

    DATASET_KINDS = ("stale_dataset_status", "stale_mount", "lost_publish")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.http: list[dict] = []
        self.session_errors: list[dict] = []
        self.kills: list[dict] = []
        self.stale_statuses: list[dict] = []
        self.datasets: dict[str, list[dict]] = {kind: [] for kind in self.DATASET_KINDS}

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
            elif kind in self.DATASET_KINDS:  # see dataset_versions, mount_version and take_lost_publish
                fault.setdefault("dataset", "*")
                self.datasets[kind].append(fault)
            else:
                raise ApiError(400, f"unknown fault kind {kind!r}")

    def clear(self) -> None:
        with self.lock:
            self.http.clear()
            self.session_errors.clear()
            self.kills.clear()
            self.stale_statuses.clear()
            for faults in self.datasets.values():
                faults.clear()

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

    def _take_dataset(self, kind: str, ref: str) -> bool:
        with self.lock:
            return self._take(self.datasets[kind], lambda f: f["dataset"] in ("*", ref)) is not None

    def dataset_versions(self, ds: dict, live: list[dict]) -> list[dict]:
        """The live versions a call that names no version sees (GetDatasetStatus, GetDataset, an unversioned
        download): all of them, or (a stale_dataset_status fault, one call each) all but the newest."""
        if len(live) > 1 and self._take_dataset("stale_dataset_status", ds["ref"]):
            return live[:-1]
        return live

    def mount_version(self, ds: dict, ready: list[dict]) -> dict:
        """The version a session mounts: the newest ready one, or (a stale_mount fault) the one before it."""
        if len(ready) > 1 and self._take_dataset("stale_mount", ds["ref"]):
            return ready[-2]
        return ready[-1]

    def take_lost_publish(self, ref: str) -> bool:
        """Whether a create of (a version of) dataset `ref` reports success and lands nothing (a lost_publish
        fault)."""
        return self._take_dataset("lost_publish", ref)
