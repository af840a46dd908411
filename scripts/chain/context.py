"""What every stage works with (the config, the Kaggle client, the state file, the work folder), and what every
stage does with it: push a kernel exactly once however often the chain is restarted, and wait for the pushed
version to end."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from scripts.chain.client import ACTIVE, TERMINAL, ApiFailure, KaggleClient
from scripts.chain.config import ChainConfig, one_line
from scripts.chain.limits import SESSION_MAX_S
from scripts.chain.state import State
from shared.errors import UserError, http_status, is_transient


@dataclasses.dataclass
class StageContext:
    """The chain's parts a stage uses. The stages read `cfg` and call `client`; only the chain builds this."""

    cfg: ChainConfig
    client: KaggleClient
    state: State
    workdir: Path

    def log(self, text: str) -> None:
        self.client.log(text)

    def ref(self, slug: str) -> str:
        return self.client.ref(slug)

    def push_once(self, key: str, ref: str, build: Callable[[str], Path], limit_s: float | None = None) -> int:
        """Push the kernel `build(push_id)` builds, once for `key` however often the chain is restarted; `limit_s`:
        this session's own time limit (a train session sized from measured start-up), else the config's.

        Before the push the state records the push id (which the built code carries) and the kernel's version;
        a restart finds an unrecorded push by that id in the kernel's newest source.
        """
        rec = self.state.pushes.get(key)
        if rec and rec.get("version"):
            return rec["version"]
        if rec:  # pushed before a kill? The newest version's code carries the push id if so.
            version = self._landed(rec, ref)
            if version:
                self.log(f"  found {ref} version {version} pushed before a restart")
                return version
        else:
            rec = {"push_id": f"{key}-{uuid.uuid4().hex[:12]}", "ref": ref}
            self.state.pushes[key] = rec
        rec["prev_version"], _ = self.client.kernel_info(ref)
        self.state.save()
        folder = build(rec["push_id"])
        for attempt in range(1, self.cfg.retry_attempts + 1):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    resp = self.client.api.kernels_push(str(folder), timeout=self.session_timeout(key, limit_s))
                break
            except Exception as err:
                if not is_transient(err) or attempt == self.cfg.retry_attempts:
                    raise ApiFailure(f"push of {ref}: {self.client.describe(err)}", http_status(err)) from None
                version = self._landed(rec, ref)  # did it land although the answer was lost?
                if version:
                    return version
                self.log(f"  push of {ref}: {self.client.describe(err)}; retrying (attempt {attempt})")
                self.client.sleep(self.cfg.retry_base_s * 2 ** (attempt - 1))
        if getattr(resp, "error", None):
            del self.state.pushes[key]
            self.state.save()
            raise UserError(f"push of {ref} refused: {one_line(resp.error)}")
        rec.update(version=int(resp.version_number or 0) or self.client.kernel_info(ref)[0], pushed=time.time())
        self.state.save()
        invalid = list(resp.invalid_dataset_sources or []) + list(resp.invalid_kernel_sources or [])
        if invalid:
            raise UserError(f"{ref} version {rec['version']} was pushed without inputs that do not exist: "
                            f"{', '.join(invalid)}")
        return rec["version"]

    def _landed(self, rec: dict, ref: str) -> int:
        """The version of `ref` that carries the push id of `rec`, recorded; 0 if none since `prev_version` does.
        Each version is read by its own label, newest first: a push made after ours (the user's, from the UI)
        does not hide ours."""
        current, _ = self.client.kernel_info(ref)
        for version in range(current, rec["prev_version"], -1):
            if rec["push_id"] in self.client.kernel_info(ref, version)[1]:
                rec.update(version=version, pushed=time.time())
                self.state.save()
                return version
        return 0

    def session_timeout(self, key: str = "", limit_s: float | None = None) -> str | None:
        """sessionTimeoutSeconds "must be lower than the global maximum" (kagglesdk): at the maximum, none is sent
        and Kaggle's own limit applies. session_limit_s is the train sessions' limit and eval_session_limit_s the
        eval's; a tokenize part (push key tokenize-*) runs on its own machine, whose own limit applies (it stops at
        its own output budget)."""
        if key.startswith("tokenize"):
            return None
        cfg = self.cfg
        limit, kind = ((cfg.eval_session_limit_s, cfg.eval_kind) if key == "eval"
                       else (limit_s or cfg.session_limit_s, cfg.accelerator_kind))
        return None if limit >= SESSION_MAX_S[kind] else str(int(limit))

    def wait(self, ref: str, label: str, key: str | None = None) -> tuple[str, str, float]:
        """Poll until the version pushed for `key` ends; backoff from poll_initial_s to poll_max_s.

        The status of the pushed version is asked for by its label, so a finished status is that version's.
        Only where the version is unknown does the newest version's status stand in; right after a push that may
        still report the previous version's end, so a finished status then counts once the pushed version was seen
        queued or running, or stale_status_s after the push (a session that ended between two polls)."""
        rec = self.state.pushes.get(key) if key else None
        version = int((rec or {}).get("version") or 0)
        interval, last, start, told = self.cfg.poll_initial_s, None, time.monotonic(), False
        while True:
            status, message = self.client.kernel_status(ref, version)
            if status != last:
                self.log(f"  {label}: {status.lower()}" + (f" ({message})" if message else ""))
                last = status
            if rec is not None and status in ACTIVE and not rec.get("seen_active"):
                rec["seen_active"] = True
                self.state.save()
            if status in TERMINAL:
                pushed = rec.get("pushed", 0) if rec is not None else 0
                if (rec is None or version or rec.get("seen_active")
                        or time.time() - pushed >= self.cfg.stale_status_s):
                    return status, message, time.monotonic() - start
                if not told:
                    self.log(f"  {label}: not seen queued or running yet; taking {status.lower()} as the previous "
                             f"version's until it is, or {self.cfg.stale_status_s:g}s after the push")
                    told = True
            self.client.sleep(interval)
            interval = min(interval * 1.5, self.cfg.poll_max_s)
