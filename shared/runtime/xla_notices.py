"""torch_xla's known-harmless messages, each explained once in one line instead of repeated: everything else (real
warnings and errors) passes untouched.

- "You are trying to use a feature that requires jax/pallas": torch_xla 2.8 logs it at every sharding call when
  jax is not importable (the TPU image's stand-in here; Kaggle's TPU image has jax: docs/kaggle-tpu.md). The step
  needs jax only for the Pallas attention kernel, which a session without jax never selects.
- "XLA_USE_SPMD is being deprecated": where a user's environment sets XLA_USE_SPMD; `xr.use_spmd()` is what
  turns SPMD on here.
- "Failed to deserialize executable: UNIMPLEMENTED": the CPU client cannot load the compiled graphs a checkpoint
  carries (a TPU's can), so it compiles them again.
- "GSPMD sharding propagation is going to be deprecated": torch_xla 2.9's XLA says it at every SPMD compilation
  (three in a session's first steps); 2.8's (the TPU image's) does not.
The last two come from C++ on stderr, where no filter reaches: the trainer explains them once before they appear
(`runtime_notices`).
"""

from __future__ import annotations

import logging
import warnings

PALLAS_MESSAGE = "requires jax/pallas"
PALLAS_NOTICE = ("notice: torch_xla asks for jax at each sharding call, and jax does not import here: harmless for "
                 "the step, since only the Pallas attention kernel needs it and SDPA attention runs instead (said "
                 "once, not per call)")


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


def runtime_notices(device_type: str, torch_xla_version: str | None, restored: bool) -> list[str]:
    """The lines that explain XLA's C++ warnings before they appear: for CPU devices whose checkpoint carried
    compiled graphs (`restored`), and for torch_xla 2.9 and later."""
    notices = []
    if device_type == "CPU" and restored:
        notices.append("notice: the checkpoint carried its compiled graphs, which torch_xla's CPU devices cannot load "
                       "(a TPU can): the 'Failed to deserialize executable: UNIMPLEMENTED' warnings that follow are "
                       "harmless, the graphs compile again")
    major_minor = tuple(int(p) for p in (torch_xla_version or "0.0").split("+")[0].split(".")[:2] if p.isdigit())
    if major_minor >= (2, 9):
        notices.append(f"notice: torch_xla {torch_xla_version}'s XLA warns at each compilation that 'GSPMD sharding "
                       "propagation is going to be deprecated': harmless, SPMD here still runs on GSPMD")
    return notices
