"""Pallas kernels and the libtpu that compiles them: the Mosaic serialization version.

jax serializes a Pallas (Mosaic) kernel at a version it picks from the TPU's libtpu build date, and libtpu refuses
a newer one: "Unsupported version: expected <= 4 but got 7". jax 0.7.1 picks 4 for a libtpu built before
2025-06-19 (jax/_src/tpu_custom_call.py `get_ir_version`, L66-77); jax 0.7.2 picks 7 for any libtpu built before
2025-08-14 (the same function, L66-75 of 0.7.2). Kaggle's TPU image pairs jax 0.7.2 with libtpu 0.0.17, built on
2025-06-12 (its compile-only client's platform_version: "Built on Jun 12 2025 16:39:57 (1749771597)"), which
reads at most version 4: the TPU compiler refuses the flash-attention kernel as that jax serializes it, and accepts
it at version 4 (docs/tpu-throughput.md, "Flash attention, compiled"). A session whose flash probe fails so pins
the version libtpu names, and probes once more.

jax caches what it traced and lowered (0.7.2: jax/_src/pjit.py `_create_pjit_jaxpr` L1323-1324 and `_pjit_lower`
L1837-1838, jax/_src/interpreters/pxla.py `_cached_lowering_to_hlo` L1919-1920), keyed on the function and its
jaxpr, not on the version: a kernel lowered again after the pin would be served the module lowered before it. The
pin so clears jax's caches too (`jax.clear_caches`, jax/_src/api.py L3185-3199).
"""

from __future__ import annotations

import datetime
import re

_UNSUPPORTED = re.compile(r"Unsupported version: expected <= (\d+) but got (\d+)")
# jax 0.7.1's ladder (jax/_src/tpu_custom_call.py L66-77): a libtpu built before the date reads at most the version.
_LADDER = ((datetime.date(2025, 6, 19), 4), (datetime.date(2025, 7, 25), 5), (datetime.date(2025, 7, 27), 6),
           (datetime.date(2025, 8, 14), 7))


def libtpu_build_date(platform_version: str) -> datetime.date | None:
    """The build date in a TPU client's platform_version ("... Built on Jun 12 2025 16:39:57 (1749771597) ...")."""
    found = re.search(r"\((\d{9,})\)", platform_version)
    if not found:
        return None
    return datetime.datetime.fromtimestamp(int(found.group(1)), tz=datetime.timezone.utc).date()


def version_for_libtpu(built: datetime.date) -> int | None:
    """The highest Mosaic version a libtpu built on `built` reads, by jax 0.7.1's ladder; None: jax's latest."""
    return next((version for before, version in _LADDER if built < before), None)


def readable_version(error: str) -> int | None:
    """The highest Mosaic version libtpu reads, where `error` is its refusal of a newer one; else None."""
    found = _UNSUPPORTED.search(error)
    return int(found.group(1)) if found else None


def refusal_line(error: str) -> str | None:
    """libtpu's refusal of a Mosaic version, as one line, wherever it sits in a longer error; else None."""
    found = _UNSUPPORTED.search(error)
    return found.group(0) if found else None


# The Mosaic version of this process's kernels: the one pinned, else what jax's own `get_ir_version` gave at the
# last lowering (None: jax's newest), as `watch_version` records it.
_in_use: dict = {}


def pin_version(version: int) -> bool:
    """Have jax serialize Pallas kernels at Mosaic `version` in this process (jax's own forward-compatibility
    path: `get_ir_version` returns an older version for an older libtpu) and forget the kernels jax and torch_xla
    have already lowered. False where this jax has no such hook (then nothing is changed)."""
    try:
        import jax._src.tpu_custom_call as tpu_custom_call
    except ImportError:
        return False
    if not callable(getattr(tpu_custom_call, "get_ir_version", None)):
        return False
    tpu_custom_call.get_ir_version = lambda ctx: version
    _in_use["pinned"] = version
    import jax

    jax.clear_caches()  # its traces and lowerings: the kernel is lowered afresh, at `version`
    try:
        from torch_xla.experimental import custom_kernel

        custom_kernel.trace_pallas_arg_to_payload.clear()  # its cache of payloads does not key on the version
    except (ImportError, AttributeError):
        pass
    try:  # nor does call_jax's (jax's splash attention, shared/train/splash.py)
        from torch_xla.core import xla_builder

        xla_builder._JAX_TO_XLA_COMPUTATION_CACHE.clear()
    except (ImportError, AttributeError):
        pass
    return True


def watch_version() -> None:
    """Record the Mosaic version jax's own `get_ir_version` picks each time a kernel is lowered (for
    `version_in_use`); where jax is imported, once per process. Nothing where this jax has no such hook."""
    try:
        import jax._src.tpu_custom_call as tpu_custom_call
    except ImportError:
        return
    own = getattr(tpu_custom_call, "get_ir_version", None)
    if not callable(own) or getattr(own, "watched", False) or "pinned" in _in_use:
        return

    def watched(ctx):
        _in_use["jax"] = version = own(ctx)
        return version

    watched.watched = True
    tpu_custom_call.get_ir_version = watched


def version_in_use() -> str | None:
    """The Mosaic version this process lowers Pallas kernels at, as the session's versions line says it: "4
    (pinned)", "7" (jax's choice for this libtpu), "jax's newest"; None where no kernel was lowered yet."""
    if "pinned" in _in_use:
        return f"{_in_use['pinned']} (pinned)"
    if "jax" in _in_use:
        return "jax's newest" if _in_use["jax"] is None else str(_in_use["jax"])
    return None
