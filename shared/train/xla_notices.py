"""torch_xla's known-harmless messages, each explained once in one line instead of repeated: everything else (real
warnings and errors) passes untouched.

- "You are trying to use a feature that requires jax/pallas": torch_xla 2.8 logs it at every sharding call when
  jax is not importable (the TPU image's stand-in here; Kaggle's TPU image has jax: docs/kaggle-tpu.md). The step
  needs jax only for the Pallas attention kernel, which a session without jax never selects.
- "XLA_USE_SPMD is being deprecated": where a user's environment sets XLA_USE_SPMD; `xr.use_spmd()` is what
  turns SPMD on here.
- "Failed to deserialize executable: UNIMPLEMENTED": the CPU client cannot load the compiled graphs a checkpoint
  carries (a TPU's can), so it compiles them again. It comes from C++ on stderr, where no filter reaches: the
  trainer explains it once before it appears (`compile_cache_notice`).
"""

from __future__ import annotations

import logging
import warnings

PALLAS_MESSAGE = "requires jax/pallas"
PALLAS_NOTICE = ("notice: torch_xla asks for jax at each sharding call and this image has none: harmless, since "
                 "only the Pallas attention kernel needs it and SDPA attention runs instead (said once, not per call)")


class _SayOnce(logging.Filter):
    """Drops a known message logged again and again, after saying once what it means."""

    def __init__(self, needle: str, notice: str, log):
        super().__init__()
        self.needle, self.notice, self.log, self.said = needle, notice, log, False

    def filter(self, record: logging.LogRecord) -> bool:
        if self.needle not in record.getMessage():
            return True
        if not self.said:
            self.said = True
            self.log(self.notice)
        return False


def quiet_known_messages(log=print) -> None:
    """Install the filters (once per process): torch_xla logs the pallas line through the root logger."""
    root = logging.getLogger()
    if not any(isinstance(f, _SayOnce) for f in root.filters):
        root.addFilter(_SayOnce(PALLAS_MESSAGE, PALLAS_NOTICE, log))
    warnings.filterwarnings("once", message="XLA_USE_SPMD is being deprecated")


def compile_cache_notice(device_type: str, restored: bool) -> str | None:
    """The line that explains XLA's deserialization warning before it appears: CPU devices, graphs restored."""
    if device_type != "CPU" or not restored:
        return None
    return ("notice: the checkpoint carried its compiled graphs, which torch_xla's CPU devices cannot load (a TPU "
            "can): the 'Failed to deserialize executable: UNIMPLEMENTED' warnings that follow are harmless, the "
            "graphs compile again")
