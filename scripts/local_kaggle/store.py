"""The on-disk state: <root>/state.json (datasets, kernels and their versions, uploads), its lock and its ids."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

from .files import atomic_write_json, read_json

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
