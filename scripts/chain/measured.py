"""What the sessions measured of what the plan otherwise assumes (shared/kaggle/facts.py): each publish's upload rate
and its time until the version was ready, where the session's clock may have started, the notebook token's scope and
expiry, /kaggle/temp's disk, and the image's packages. After each train session the chain keeps a summary in its
state (the session's record) and, for sessions on Kaggle (not the local Kaggle, whose uploads are a loopback's),
appends it to runs/measured-kaggle.json beside --smoke's runs/measured-throughput.json; --plan then sizes the
uploads with the measured rate and says the measured time to ready (`publish_line`)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from scripts.chain.limits import ASSUMED_UPLOAD_BYTES_PER_S

REPO = Path(__file__).resolve().parents[2]
MEASURED_KAGGLE = REPO / "runs" / "measured-kaggle.json"


def facts_summary(facts: dict) -> dict:
    """The parts of a session's facts the chain keeps (the freeze stays in the session's own facts file)."""
    publishes = [p for p in facts.get("publishes") or [] if isinstance(p, dict)]
    summary = {"local_kaggle": bool((facts.get("session") or {}).get("local_kaggle")),
               "uploads_mb_s": [p["mb_s"] for p in publishes if p.get("mb_s")],
               "upload_bytes": [p["bytes"] for p in publishes if p.get("bytes")],
               "ready_s": [p["ready_s"] for p in publishes if p.get("ready_s") is not None]}
    for key in ("clock", "token", "disk"):
        if facts.get(key):
            summary[key] = facts[key]
    image = facts.get("image") or {}
    if image.get("freeze"):
        summary["image"] = {"python": image.get("python"), "packages": len(image["freeze"])}
    return summary


def keep_session_facts(facts_file: Path, chain: str, path: Path = MEASURED_KAGGLE) -> dict:
    """The summary of a session's facts file ({} where it has none), appended to `path` where the session ran on
    Kaggle and published."""
    try:
        facts = json.loads(Path(facts_file).read_text())
    except (OSError, ValueError):
        return {}
    summary = facts_summary(facts)
    if summary["local_kaggle"] or not (summary["uploads_mb_s"] or summary["ready_s"]):
        return summary
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        records = []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records + [{"chain": chain, "measured_at": time.strftime("%Y-%m-%d %H:%M"),
                                           **summary}], indent=1))
    return summary


def measured_publishes(path: Path = MEASURED_KAGGLE) -> dict | None:
    """The median upload rate (bytes/s) and time to ready (s) of every publish on Kaggle recorded so far, with how
    many there were and the newest record's date; None where none was."""
    try:
        records = [r for r in json.loads(path.read_text()) if not r.get("local_kaggle")]
    except (OSError, ValueError, AttributeError):
        return None
    rates = [mb_s * 1e6 for r in records for mb_s in r.get("uploads_mb_s") or []]
    ready = [s for r in records for s in r.get("ready_s") or []]
    if not rates and not ready:
        return None
    return {"bytes_per_s": statistics.median(rates) if rates else None, "uploads": len(rates),
            "ready_s": statistics.median(ready) if ready else None, "readies": len(ready),
            "newest": records[-1].get("measured_at", "?")}


def publish_line(creates: int, version_bytes: int, margin_s: float, path: Path = MEASURED_KAGGLE) -> str:
    """--plan's words on a session's final publish: `creates` versions of `version_bytes` (a deleting publish
    uploads its version twice) at the measured upload rate (else the assumed one), each waited for until ready at
    the measured time, against the publish margin."""
    measured = measured_publishes(path) or {}
    rate, ready = measured.get("bytes_per_s"), measured.get("ready_s")
    upload_s = creates * version_bytes / (rate or ASSUMED_UPLOAD_BYTES_PER_S)
    where = (f"a measured {rate / 1e6:.1f} MB/s (median of {measured['uploads']} upload(s) on Kaggle, newest "
             f"{measured['newest']})" if rate else
             f"an assumed {ASSUMED_UPLOAD_BYTES_PER_S / 1e6:g} MB/s (not measured yet: each session records its own)")
    ready_words = (f", each version ready {ready:.0f} s after its create (measured, median of {measured['readies']})"
                   if ready is not None else "; the time until a version is ready is not measured yet")
    total_s = upload_s + creates * (ready or 0)
    short = (f"; warning: ~{total_s:.0f} s in all, more than the {margin_s:.0f}-s publish margin: raise "
             "publish_margin_s" if total_s > margin_s else "")
    return (f"{creates} version(s) of {version_bytes / 1e9:.2f} GB upload in ~{upload_s:.0f} s at {where}"
            f"{ready_words}{short}")
