"""How many checkpoint versions a chain keeps live at once, so that its checkpoint dataset stays under the account's
private-dataset quota (ChainConfig.dataset_quota_gb): a create past that quota answers "Ok" and lands nothing
(kaggle-cli issue 284), which would leave a session's checkpoint unpublished.

Kaggle deletes only every older version at once, when a new one is created (deleteOldVersions), and whether the
versions it deletes still count against the quota at that moment is not verified: so the version a deleting
publish makes (a copy of the session's final one, published once that is proven whole) is counted on top of those
it deletes. A session may publish twice: midway through (never deleting,
shared/kaggle/publish.py MidwayPublish), then at its end. A session's final publish deletes the older versions where the
versions live after it would pass keep_dataset_versions; the most live at once is `peak_versions`.
"""

from __future__ import annotations

from typing import NamedTuple

from scripts.chain.config import ChainConfig


class StoragePlan(NamedTuple):
    """The versions kept (`keep`: a publish that would leave more deletes the older ones), whether sessions publish
    midway, the most versions live at once and their bytes, each version's bytes, the quota's bytes, and why the
    settings were lowered to fit ('' where they were not)."""

    keep: int
    midway: bool
    peak_versions: int
    peak_bytes: int
    version_bytes: int
    quota_bytes: int
    lowered: str


def storage_plan(cfg: ChainConfig, midway: bool | None = None) -> StoragePlan:
    """The most versions kept under the quota, with keep_dataset_versions (0: as many as fit) as the ceiling; a
    midway publish only where one more version still fits beside those. `midway`: whether the chain's sessions
    publish midway (default: a session of session_limit_s does)."""
    room, size = cfg.dataset_room(), cfg.version_bytes
    wanted = cfg.midway_publish_s(cfg.session_limit_s) > 0 if midway is None else midway
    asked = cfg.keep_dataset_versions or room
    keep = _most_kept(asked, wanted, room)
    lowered = []
    if not keep:  # no room for a midway version beside the one kept: the sessions skip it
        wanted, keep = False, _most_kept(asked, False, room)
        lowered.append("no midway publish")
    if cfg.keep_dataset_versions and keep < cfg.keep_dataset_versions:
        lowered.insert(0, f"keep_dataset_versions {keep}, not {cfg.keep_dataset_versions}")
    peak = peak_versions(keep, wanted)
    why = f"{' and '.join(lowered)}, to fit the quota" if lowered else ""
    return StoragePlan(keep, wanted, peak, peak * size, size, int(cfg.dataset_quota_gb * 1e9), why)


def _most_kept(asked: int, midway: bool, room: int) -> int:
    """The most versions kept, up to `asked`, whose peak fits `room` (0: none does)."""
    return next((keep for keep in range(asked, 0, -1) if peak_versions(keep, midway) <= room), 0)


def peak_versions(keep: int, midway: bool) -> int:
    """The most versions live at once: a session adds 1 + midway versions; where they would otherwise pass `keep`
    (scripts/chain/checkpoints.py session_publishes) its final one, once proven, is published again deleting the
    older, and that copy is counted beside them. From the one version a delete leaves, the most live before a
    deleting session is 1 + k (1 + midway) <= keep; that session adds its own and the copy."""
    per_session = 1 + midway
    return 1 + per_session * ((keep - 1) // per_session) + per_session + 1


def storage_line(plan: StoragePlan) -> str:
    """--plan's words: the most versions live at once against the quota."""
    adds = "2 (midway and final)" if plan.midway else "1"
    lowered = f"; {plan.lowered}" if plan.lowered else ""
    return (f"at most {plan.peak_versions} checkpoint versions live at once, {plan.version_bytes / 1e9:.1f} GB each: "
            f"{plan.peak_bytes / 1e9:.1f} GB of the {plan.quota_bytes / 1e9:g} GB private-dataset quota "
            f"(dataset_quota_gb{lowered}); a session adds {adds}, and where more than {plan.keep} would stay, a copy "
            "of its final one, once proven, deletes the older (counted before Kaggle deletes them)")
