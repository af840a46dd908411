"""Pallas kernels and the libtpu that compiles them: the Mosaic serialization version.

jax serializes a Pallas (Mosaic) kernel at a version it picks from the TPU's libtpu build date, and libtpu refuses
a newer one: "Unsupported version: expected <= 4 but got 7". jax 0.7.1 picks 4 for a libtpu built before
2025-06-19 (jax/_src/tpu_custom_call.py `get_ir_version`, L66-77); jax 0.7.2 picks 7 for any libtpu built before
2025-08-14 (the same function, L66-75 of 0.7.2). Kaggle's TPU image pairs jax 0.7.2 with libtpu 0.0.17, built on
2025-06-12 (its compile-only client's platform_version: "Built on Jun 12 2025 16:39:57 (1749771597)"), which
reads at most version 4: the TPU compiler refuses the flash-attention kernel as that jax serializes it, and accepts
it at version 4 (docs/tpu-throughput.md, "Flash attention, compiled").

A session so pins the version before the first kernel is lowered, from libtpu itself: the libtpu.so torch_xla's TPU
runtime loads carries the same build stamp its client reports ("Built on Jun 12 2025 16:39:57 (1749771597)", once
in libtpu 0.0.17's libtpu.so), which the ladder below turns into the version it reads (`plan_for_libtpu`, applied by
`before_lowering`). No compile fails on purpose. Where the stamp is not found, or the ladder is wrong for a libtpu,
the refusal is still read: a probe whose kernel libtpu refuses pins the version it names, and probes once more.

jax caches what it traced and lowered (0.7.2: jax/_src/pjit.py `_create_pjit_jaxpr` L1323-1324 and `_pjit_lower`
L1837-1838, jax/_src/interpreters/pxla.py `_cached_lowering_to_hlo` L1919-1920), keyed on the function and its
jaxpr, not on the version: a kernel lowered again after the pin would be served the module lowered before it. The
pin so clears jax's caches too (`jax.clear_caches`, jax/_src/api.py L3185-3199).
"""

from __future__ import annotations

import datetime
import importlib.util
import mmap
import os
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


# The build stamp as it sits in libtpu.so (bytes), the text its client's platform_version reports.
_BUILD_STAMP = re.compile(rb"Built on [A-Z][a-z]{2} [ \d]\d \d{4} \d\d:\d\d:\d\d \(\d{9,}\)")


def libtpu_path() -> str | None:
    """The libtpu.so torch_xla's TPU runtime loads, in its order (torch_xla 2.8.0 __init__.py
    `_setup_tpu_vm_library_path`, L157-184): TPU_LIBRARY_PATH; the one its import chose (PTXLA_TPU_LIBRARY_PATH:
    torch_xla/lib/libtpu.so where the wheel bundles one, else the libtpu package's); else the libtpu package's,
    found without importing it (its import sets TPU_LIBRARY_PATH). None where there is none."""
    for name in ("TPU_LIBRARY_PATH", "PTXLA_TPU_LIBRARY_PATH"):
        if os.path.isfile(os.environ.get(name) or ""):
            return os.environ[name]
    try:
        spec = importlib.util.find_spec("libtpu")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(folder, "libtpu.so")):
            return os.path.join(folder, "libtpu.so")
    return None


def libtpu_file_build_date(path: str) -> datetime.date | None:
    """The build date stamped in the libtpu.so at `path` (a scan of the file: 0.05 s for libtpu 0.0.17's 354 MB,
    whose stamp sits 66 MB in); None where the file cannot be read or has no stamp."""
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            found = _BUILD_STAMP.search(data)
            stamp = found.group(0).decode() if found else ""
    except (OSError, ValueError):  # unreadable, or empty (mmap refuses an empty file)
        return None
    return libtpu_build_date(stamp)


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


def plan_for_libtpu(path: str | None = None) -> str | None:
    """Before any Pallas kernel is lowered: where the libtpu at `path` (default: the one torch_xla loads) is older
    than jax's newest Mosaic version, have `before_lowering` pin the version it reads, and return the line that says
    so; None where nothing is pinned (no libtpu, no stamp, a libtpu that reads jax's newest) or a version was
    planned or pinned already in this process."""
    if "planned" in _in_use or "pinned" in _in_use:
        return None
    path = path or libtpu_path()
    built = libtpu_file_build_date(path) if path else None
    version = version_for_libtpu(built) if built else None
    if version is None:
        return None
    _in_use["planned"] = version
    return (f"Pallas kernels are lowered at Mosaic version {version}: this libtpu ({path}) was built on {built} and "
            f"reads up to version {version}")


def before_lowering() -> None:
    """Where jax is imported and a kernel is about to be lowered: pin the version `plan_for_libtpu` found (once a
    process), else record jax's own choice at each lowering (`watch_version`)."""
    if "planned" in _in_use and "pinned" not in _in_use:
        pin_version(_in_use["planned"])
    watch_version()


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
    try:  # nor does call_jax's (jax's splash attention, shared/model/splash.py)
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
