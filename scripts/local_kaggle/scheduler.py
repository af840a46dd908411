"""The scheduler: starts queued kernel versions in push order, as many at once as each kind of machine allows
(TPU, GPU, CPU), after a short queued time; and cancels, kills and stops the sessions it started."""

from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING

from kagglesdk.kernels.types.kernels_api_service import ApiCancelKernelSessionResponse

from .errors import ApiError
from .rules import TERMINAL, check_owner
from .sdk import message
from .sessions import Session

if TYPE_CHECKING:
    from .app import LocalKaggle


class Scheduler:
    def __init__(self, app: LocalKaggle):
        self.app = app
        self.sessions: dict[tuple[str, int], Session] = {}  # (kernel ref, version) -> running session

    def loop(self, stop: threading.Event) -> None:
        while not stop.wait(0.05):
            try:
                self.schedule_once()
            except Exception as err:  # keep scheduling; report
                print(f"local-kaggle: scheduler error: {err!r}", file=sys.stderr)

    def schedule_once(self) -> None:
        store, settings = self.app.store, self.app.settings
        with store.lock:
            versions = [(kernel, v) for kernel in store.state["kernels"].values() for v in kernel["versions"]]
            running = {"tpu": 0, "gpu": 0, "cpu": 0}
            for _kernel, v in versions:
                if v["status"] == "RUNNING":
                    running[v.get("accelerator") or "cpu"] += 1
            queued = sorted(((v["queued_at"], kernel, v) for kernel, v in versions if v["status"] == "QUEUED"),
                            key=lambda item: item[0])
            now = time.time()
            for queued_at, kernel, v in queued:
                kind = v.get("accelerator") or "cpu"
                if queued_at + settings.queue_delay_s > now or running[kind] >= settings.concurrency[kind]:
                    continue
                running[kind] += 1
                v["status"] = "RUNNING"
                v["started"] = now
                session = Session(self.app, kernel, v, self.app.faults.take_kill(kernel["ref"]))
                self.sessions[(kernel["ref"], v["number"])] = session
                store.save()
                threading.Thread(target=session.run, daemon=True).start()

    def cancel(self, user: str, session_id: int) -> ApiCancelKernelSessionResponse:
        """CancelKernelSession names the session (one version of a kernel) by its kernelSessionId only."""
        store = self.app.store
        with store.lock:
            found = [(k, v) for k in store.state["kernels"].values() for v in k["versions"]
                     if v.get("session_id") == session_id]
            if not found:
                raise ApiError(404, f"Kernel session {session_id} not found")
            kernel, v = found[0]
            check_owner(user, kernel, "kernel")
            if v["status"] in TERMINAL:
                return message(ApiCancelKernelSessionResponse,
                               error_message=f"Kernel session {session_id} has already ended ({v['status']})")
            session = self.sessions.get((kernel["ref"], v["number"]))
            if v["status"] == "QUEUED":
                v["status"] = "CANCEL_ACKNOWLEDGED"
                v["failure_message"] = "Cancelled by the user"
                v["ended"] = time.time()
                store.save()
        if session is not None:
            session.kill("Cancelled by the user", status="CANCEL_ACKNOWLEDGED")
        return ApiCancelKernelSessionResponse()

    def kill(self, ref: str, reason: str) -> bool:
        """Kill the kernel's running sessions; False when it has none."""
        with self.app.store.lock:
            running = [s for (r, _), s in self.sessions.items() if r == ref]
        for s in running:
            s.kill(reason)
        return bool(running)

    def stop_all(self, reason: str) -> None:
        """Kill every running session and wait (a while) for each to record its end."""
        with self.app.store.lock:
            running = list(self.sessions.values())
        for s in running:
            s.kill(reason)
        for s in running:
            s.done.wait(10)
