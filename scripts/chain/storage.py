"""How many checkpoint versions a chain keeps live at once, so that its two checkpoint datasets stay under the
account's private-dataset quota (ChainConfig.dataset_quota_gb): a create past that quota answers "Ok" and lands
nothing (kaggle-cli issue 284), which would leave a session's checkpoint unpublished.

A session resumes from one checkpoint dataset and publishes to the other (scripts/chain/checkpoints.py
`publish_target`). Kaggle deletes only every older version at once, when a new one is created (deleteOldVersions),
and whether the versions it deletes still count against the quota at that moment is not verified: so the version a
deleting publish makes is counted on top of those it deletes. A session may publish twice: midway through (never
deleting, shared/kaggle/publish.py MidwayPublish), then at its end. A session's final publish deletes the older
versions of its dataset where the versions live there after it would pass keep_dataset_versions; the most live at
once, in both datasets, is `peak_versions`.
"""

from __future__ import annotations

from typing import NamedTuple

from scripts.chain.checkpoint_room import checkpoints_in_temp, keeps_stable
from scripts.chain.config import ChainConfig
from shared.kaggle.disk import disk_needs, peak_bytes


class StoragePlan(NamedTuple):
    """The versions kept (`keep`: a publish that would leave more deletes the older ones), whether sessions publish
    midway, the most versions live at once and their bytes, each version's bytes, the quota's bytes, and why the
    settings were lowered to fit ('' where they were not); `taken`: the bytes the user's other private datasets
    take of the quota (read at the chain's start: `private_taken`)."""

    keep: int
    midway: bool
    peak_versions: int
    peak_bytes: int
    version_bytes: int
    quota_bytes: int
    lowered: str
    taken: int = 0


def storage_plan(cfg: ChainConfig, midway: bool | None = None, taken: int = 0) -> StoragePlan:
    """The most versions kept under the quota less `taken` bytes (the user's other private datasets), with
    keep_dataset_versions (0: as many as fit) as the ceiling; a midway publish only where one more version still fits
    beside those. `midway`: whether the chain's sessions publish midway (default: a session of session_limit_s
    does)."""
    room, size = cfg.dataset_room(taken), cfg.version_bytes
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
    return StoragePlan(keep, wanted, peak, peak * size, size, int(cfg.dataset_quota_gb * 1e9), why, taken)


def _most_kept(asked: int, midway: bool, room: int) -> int:
    """The most versions kept, up to `asked`, whose peak fits `room` (0: none does)."""
    return next((keep for keep in range(asked, 0, -1) if peak_versions(keep, midway) <= room), 0)


def peak_versions(keep: int, midway: bool) -> int:
    """The most versions live at once in both checkpoint datasets: a session adds 1 + midway versions to the one it
    publishes to; where they would pass `keep` there (scripts/chain/checkpoints.py session_publishes) its final
    create deletes that dataset's older versions, counted beside them. From the one version a delete leaves, a
    dataset holds at most 1 + k (1 + midway) <= keep between sessions; the other holds as many at most, and the
    deleting session adds its own."""
    per_session = 1 + midway
    between = 1 + per_session * ((keep - 1) // per_session)
    return 2 * between + per_session


def storage_line(plan: StoragePlan) -> str:
    """--plan's words: the most versions live at once against the quota."""
    adds = "2 (midway and final)" if plan.midway else "1"
    lowered = f"; {plan.lowered}" if plan.lowered else ""
    return (f"at most {plan.peak_versions} checkpoint versions live at once in the two checkpoint datasets, "
            f"{plan.version_bytes / 1e9:.1f} GB each: {plan.peak_bytes / 1e9:.1f} GB of the "
            f"{plan.quota_bytes / 1e9:g} GB private-dataset quota (dataset_quota_gb{lowered}); a session adds {adds} "
            f"to the one it publishes to, and where more than {plan.keep} would stay there, its final create deletes "
            "that one's older versions (one upload, counted before Kaggle deletes them; the other dataset keeps the "
            "checkpoint it resumed from)")


def private_taken(datasets: dict[str, int], checkpoint_refs: tuple[str, ...]) -> int:
    """Bytes the user's private datasets other than the chain's checkpoint datasets take of the quota (its token
    datasets among them, where private and the user's)."""
    return sum(size for ref, size in datasets.items() if ref not in checkpoint_refs)


def room_line(cfg: ChainConfig, plan: StoragePlan, datasets: dict[str, int] | None,
              checkpoint_refs: tuple[str, ...], why: str = "") -> str:
    """--plan's words on the quota's room: what the user's other private datasets take (the config's token
    datasets named), what is left, and what the checkpoint versions need of it; without a listing, why."""
    if datasets is None:
        return (f"your other private datasets were not read ({why or 'no credentials'}): the whole "
                f"{plan.quota_bytes / 1e9:g} GB quota is counted as the chain's; they share it")
    others = {ref: size for ref, size in datasets.items() if ref not in checkpoint_refs}
    tokens = sum(others.get(ref, 0) for ref in cfg.token_datasets)
    left = plan.quota_bytes - plan.taken
    named = f", the token datasets {tokens / 1e9:.1f} GB of it" if tokens else ""
    return (f"{len(others)} other private dataset(s) of yours take {plan.taken / 1e9:.1f} GB{named} (ListDatasets' "
            f"sizes): {left / 1e9:.1f} GB of the quota is left, {max(0, left - plan.peak_bytes) / 1e9:.1f} GB of it "
            "beyond the checkpoint versions at their most")


def session_disk(cfg: ChainConfig) -> dict[str, int]:
    """What a train session puts on /kaggle/temp's disk, by part (shared/kaggle/disk.py): baked into the train
    kernel, whose bootstrap compares it with the free disk before training."""
    train = cfg.train.config
    return disk_needs(cfg.checkpoint_bytes, cfg.version_bytes, train.session.keep_checkpoints, keeps_stable(train))


def disk_line(cfg: ChainConfig, midway: bool) -> str:
    """--plan's words: the most a train session puts on /kaggle/temp's disk at once, and what makes it up."""
    needs, in_temp = session_disk(cfg), checkpoints_in_temp(cfg.train.config)
    peak = peak_bytes(needs, fetching=True, midway=midway, rotation=in_temp)
    keep = cfg.train.config.session.keep_checkpoints
    parts = [f"{keep + 1} checkpoints rotating {_gb(needs['rotation'])}"] if in_temp else []
    if midway:
        parts.append(f"the midway publish's links {_gb(needs['midway'])}")
    parts.append(f"a fetched version {_gb(needs['fetched'])} (a stale mount; {_gb(needs['fetch'])} while its zip is "
                 "extracted)")
    where = "" if in_temp else " (the checkpoints rotate in /kaggle/working: counted too where it shares the disk)"
    return (f"/kaggle/temp holds at most {_gb(peak)} at once: {', '.join(parts)}{where}; its size on Kaggle is not "
            "verified: each session measures its free disk before training and drops the midway publish, or stops "
            "in one line, where the peak does not fit")


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
