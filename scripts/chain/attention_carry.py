"""A kernel a session found hung or failed is carried forward: the chain starts the next session from the attention
kernel after it (train.attention), and says so, instead of pushing the same settings again. A hung probe stops its
session before training (shared/runtime/attention_probe.py `ProbeHung`), after up to the probes' 15-minute budget
plus start-up; pushed again unchanged, every later session would pay the same until max_failed_sessions. A probe
that failed costs its session a probe and a fallback, again in every session.

What a session found is read from its facts (shared/kaggle/facts.py: `attention_probes`, each probed kernel's
result, written by shared/runtime/xla_runtime.py) and, where those did not come back, from its last error line (the
hung probe's, `hung_kernel`)."""

from __future__ import annotations

import json
from pathlib import Path

from shared.model.attention import FIRST_KERNEL, KERNELS, SETTING_OF, hung_kernel

PROBES_FACT = "attention_probes"  # the facts' section (shared/runtime/xla_runtime.py writes it)
SKIPPED = ("hung", "failed")  # the results that carry a kernel forward ("passed" does not)


def probe_results(facts_file: Path, error: str | None) -> dict[str, str]:
    """{setting word: "hung" | "failed" | "passed"} for the kernels a session probed, from its facts file (where it
    came back) and its last error line (a hung probe's names its kernel)."""
    try:
        facts = json.loads(Path(facts_file).read_text())
    except (OSError, ValueError):
        facts = {}
    probes = facts.get(PROBES_FACT) if isinstance(facts, dict) else None
    results = {word: str(found.get("result")) for word, found in (probes or {}).items() if isinstance(found, dict)}
    word = hung_kernel(error or "")
    if word:
        results[word] = "hung"
    return results


def carried_attention(setting: str, sessions: list[dict]) -> tuple[str, str]:
    """(the attention setting the next session starts from, why where it is not `setting`, else ''): past the last
    kernel, in the order sessions try them, that a session of this chain found hung or failed."""
    start, why = KERNELS.index(FIRST_KERNEL[setting]), ""
    for sess in sessions:
        for word, result in (sess.get(PROBES_FACT) or {}).items():
            if result not in SKIPPED or word not in FIRST_KERNEL:
                continue
            past = KERNELS.index(FIRST_KERNEL[word]) + 1
            if start < past < len(KERNELS):
                start, why = past, f"session {sess['n']}'s {word}-attention probe {result}"
    return SETTING_OF[KERNELS[start]], why
