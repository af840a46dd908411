"""What a session found about its machine, kept for the chain's readiness report (`--smoke`): which packages the
image had and which were installed, which secrets were attached (names only, never values). One small JSON file
in the session's output, rewritten as facts arrive; outside a session nothing is written."""

from __future__ import annotations

import json
import os

from shared.kaggle.env import in_session, is_local_kaggle, kaggle_paths

FACTS_FILE = "session-facts.json"


def record_fact(section: str, key: str, value) -> None:
    """facts[section][key] = value in the session's FACTS_FILE (a no-op outside a Kaggle or local session)."""
    if not in_session():
        return
    path = kaggle_paths().working / FACTS_FILE
    try:
        facts = json.loads(path.read_text())
    except (OSError, ValueError):
        facts = {}
    facts.setdefault(section, {})[key] = value
    facts["session"] = {"local_kaggle": is_local_kaggle()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(facts, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:  # a report's detail is never worth failing a session for
        pass
