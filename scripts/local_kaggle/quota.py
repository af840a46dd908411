"""Weekly accelerator quota: hours used per user and kind (TPU, GPU), counted from the sessions' start and end
times in the state, and what is refused or stopped when it runs out."""

from __future__ import annotations

import datetime as dt
import time

from kagglesdk.kernels.types.kernels_api_service import (
    ApiAcceleratorQuota,
    ApiGetAcceleratorQuotaStatisticsResponse,
)

from .rules import WEEK_S, week_start
from .sdk import message, utc
from .store import Store


class Quota:
    def __init__(self, store: Store, tpu_hours: float, gpu_hours: float):
        self.store = store
        self.allowed_s = {"tpu": tpu_hours * 3600.0, "gpu": gpu_hours * 3600.0}

    def _versions(self, user: str, kind: str) -> list[dict]:
        """The user's versions that ran (or run) on `kind`."""
        with self.store.lock:
            return [v for k in self.store.state["kernels"].values() if k["owner"] == user for v in k["versions"]
                    if v.get("accelerator") == kind and v.get("started") is not None]

    def used_s(self, user: str, kind: str, now: float | None = None) -> float:
        now = time.time() if now is None else now
        start = week_start(now)
        return sum(max(0.0, min(v.get("ended") or now, now) - max(v["started"], start))
                   for v in self._versions(user, kind))

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

    def reply(self, user: str) -> ApiGetAcceleratorQuotaStatisticsResponse:
        now = time.time()
        quotas = {
            kind: message(
                ApiAcceleratorQuota,
                time_used=dt.timedelta(seconds=self.used_s(user, kind, now)),
                total_time_allowed=dt.timedelta(seconds=self.allowed_s[kind]),
                has_ever_run=bool(self._versions(user, kind)),
            )
            for kind in ("gpu", "tpu")
        }
        return message(ApiGetAcceleratorQuotaStatisticsResponse, quota_refresh_time=utc(week_start(now) + WEEK_S),
                       gpu_quota=quotas["gpu"], tpu_quota=quotas["tpu"])
