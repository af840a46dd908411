"""What a session found about its machine, kept for the chain's readiness report (`--smoke`) and for --plan
(scripts/chain/measured.py): which packages the image had and which were installed, which secrets were attached
(names only, never values), and what the plan otherwise assumes: the image's packages as `pip freeze` would list
them (`record_image`), where the session's clock may have started against this process's start (`record_clock`),
each publish's upload rate and time until its version was ready (shared/kaggle/publish.py), the notebook token's
scope and expiry (shared/kaggle/credential.py), /kaggle/temp's disk (shared/kaggle/disk.py). One JSON file in the
session's output, rewritten as facts arrive; outside a session nothing is written."""

from __future__ import annotations

import json
import os
import sys
import time

from shared.kaggle.env import in_session, is_local_kaggle, kaggle_paths

FACTS_FILE = "session-facts.json"


def record_fact(section: str, key: str, value) -> None:
    """facts[section][key] = value in the session's FACTS_FILE (a no-op outside a Kaggle or local session)."""
    _update(lambda facts: facts.setdefault(section, {}).__setitem__(key, value))


def append_fact(section: str, value) -> None:
    """facts[section] += [value] (a list: one entry per publish)."""
    _update(lambda facts: facts.setdefault(section, []).append(value))


def _update(change) -> None:
    if not in_session():
        return
    path = kaggle_paths().working / FACTS_FILE
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError):
        facts = {}
    change(facts)
    facts["session"] = {"local_kaggle": is_local_kaggle()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(facts, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a report's detail is never worth failing a session for
        pass


def image_freeze() -> list[str]:
    """The packages this interpreter sees, as `pip freeze` lists them (name==version, sorted by name), read from
    their metadata (importlib.metadata: no pip process, and the same distributions pip lists)."""
    from importlib import metadata

    found = {}
    for dist in metadata.distributions():
        name = dist.metadata.get("Name")
        if name:
            found.setdefault(name.lower(), f"{name}=={dist.version}")
    return [found[key] for key in sorted(found)]


def record_image() -> None:
    """The image's packages before the session installs any (shared/kaggle/packages.py installs later, into
    /kaggle/temp), and its Python."""
    if in_session():
        record_fact("image", "freeze", image_freeze())
        record_fact("image", "python", sys.version.split()[0])


def _start_ticks(pid: str) -> int | None:
    """A process's start, in clock ticks after boot (/proc/<pid>/stat field 22), None where not readable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def clock_facts() -> dict:
    """What this process can read of when its session started, against its own start: the machine's boot
    (/proc/uptime), the container's first process (PID 1), and the names (never the values) of the environment's
    variables that might carry a start time. Whether Kaggle's session clock starts at any of these is not
    verified: the chain compares them across sessions with when it saw each session start."""
    ticks = os.sysconf("SC_CLK_TCK")
    own, first = _start_ticks("self"), _start_ticks("1")
    facts: dict = {"measured_at": round(time.time(), 1), "kaggle_clock_start": "not verified"}
    if own is not None:
        facts["process_after_boot_s"] = round(own / ticks, 2)
        if first is not None:
            facts["process_after_pid1_s"] = round((own - first) / ticks, 2)
        try:
            with open("/proc/uptime") as f:
                facts["process_age_s"] = round(float(f.read().split()[0]) - own / ticks, 2)
        except (OSError, ValueError, IndexError):
            pass
    facts["start_like_env"] = sorted(k for k in os.environ if any(w in k.upper() for w in ("START", "TIME", "RUN_")))
    return facts


def record_clock() -> None:
    if in_session():
        record_fact("clock", "process", clock_facts())
