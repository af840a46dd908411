"""Pallas kernels and the libtpu that compiles them: the Mosaic serialization version.

jax serializes a Pallas (Mosaic) kernel at a version it picks from the TPU's libtpu build date, and libtpu refuses
a newer one: "Unsupported version: expected <= 4 but got 7". jax 0.7.1 picks 4 for a libtpu built before
2025-06-19 (jax/_src/tpu_custom_call.py `get_ir_version`, L66-77); jax 0.7.2 picks 7 for any libtpu built before
2025-08-14 (the same function, L66-75 of 0.7.2). Kaggle's TPU image pairs jax 0.7.2 with libtpu 0.0.17, built on
2025-06-12 (its compile-only client's platform_version: "Built on Jun 12 2025 16:39:57 (1749771597)"), which
reads at most version 4: the TPU compiler refuses the flash-attention kernel as that jax serializes it, and accepts
it at version 4 (docs/tpu-throughput.md, "Flash attention, compiled"). A session whose flash probe fails so pins
the version libtpu names, and probes once more.
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


def pin_version(version: int) -> bool:
    """Have jax serialize Pallas kernels at Mosaic `version` in this process (jax's own forward-compatibility
    path: `get_ir_version` returns an older version for an older libtpu) and forget the kernels torch_xla has
    already lowered. False where this jax has no such hook (then nothing is changed)."""
    try:
        import jax._src.tpu_custom_call as tpu_custom_call
    except ImportError:
        return False
    if not callable(getattr(tpu_custom_call, "get_ir_version", None)):
        return False
    tpu_custom_call.get_ir_version = lambda ctx: version
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
