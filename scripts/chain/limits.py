"""What Kaggle accepts and allows: machine shapes, session lengths, the session's output size."""

from __future__ import annotations

from shared.config import NINE_HOURS

# Machine shapes Kaggle has accepted (kaggle-cli docs/kernels.md, Feb 2026 list) and the weekly quota each counts
# against; "" is CPU. The Sep 2026 list (docs/kernels.md @13dad8ee) drops RETIRED_SHAPES: TPU v5e-8 and v6e-8 are
# the TPUs offered now (docs/kaggle-api.md).
MACHINE_SHAPES = {
    "TpuV38": "tpu", "Tpu1VmV38": "tpu", "TpuV5E8": "tpu", "TpuV6E8": "tpu",
    "NvidiaTeslaT4": "gpu", "NvidiaTeslaT4Highmem": "gpu", "NvidiaTeslaP100": "gpu", "NvidiaTeslaA100": "gpu",
    "NvidiaL4": "gpu", "NvidiaL4X1": "gpu", "NvidiaH100": "gpu", "NvidiaRtxPro6000": "gpu",
}
# Kaggle runs a push that asks for a retired shape on another one rather than refusing it; the kaggle client only
# warns (kaggle-cli tests/unit/test_kernels_push_retired_accelerator.py @13dad8ee: "the server substitutes";
# TpuV232 and TpuV2256 become CPU there, and are not accepted here at all).
RETIRED_SHAPES = {"TpuV38": "TpuV5E8", "Tpu1VmV38": "TpuV5E8", "NvidiaTeslaP100": "NvidiaTeslaT4"}
# The shapes taken here to be open to every account: the TPUs of the Sep 2026 list and the T4s ("default GPU"). The
# list adds "Some of these are only available to participants of specific competitions, and some are only available
# to Kaggle admins" without naming them, and such flag-gated shapes "can be swapped for the default too" (the
# retired-accelerator test above, a comment): which ones are gated is not verified.
OPEN_SHAPES = {"TpuV5E8", "TpuV6E8", "NvidiaTeslaT4", "NvidiaTeslaT4Highmem"}


def shape_notices(shapes: set[str]) -> list[str]:
    """One notice per machine shape Kaggle may run on another one: retired shapes (always substituted) and shapes
    that may be open only to some accounts (swapped for the default there)."""
    notices = []
    for shape in sorted(s for s in shapes if s):
        if shape in RETIRED_SHAPES:
            notices.append(f"notice: {shape} is retired (not in Kaggle's Sep 2026 accelerator list): Kaggle runs these "
                           f"sessions on {RETIRED_SHAPES[shape]} instead; set {RETIRED_SHAPES[shape]} in the config "
                           "to say so")
        elif shape not in OPEN_SHAPES:
            default = "TpuV5E8" if MACHINE_SHAPES.get(shape) == "tpu" else "NvidiaTeslaT4"
            notices.append(f"notice: {shape} may be open only to some accounts (competitions, Kaggle admins); where "
                           f"it is not, Kaggle may run the sessions on its default ({default}) instead: each train "
                           "session's metrics.jsonl (session_start) names the device it got")
    return notices
# The longest session Kaggle runs on each kind of machine. 9 h on a TPU; 12 h is often quoted for a GPU or CPU
# (kaggle.com/docs/notebooks), but no primary source in reach says so (docs/kaggle-api.md), so a GPU session is
# planned at 9 h until one does: a session planned longer than Kaggle allows is killed with its output lost.
# kagglesdk says only that sessionTimeoutSeconds "must be lower than the global maximum"
# (kernels_api_service.py:2015-2017).
SESSION_MAX_S = {"tpu": NINE_HOURS, "gpu": NINE_HOURS, "cpu": 12 * 3600}
# /kaggle/working, the session's output, holds 20 GB (Kaggle's notebook docs; not verified here). Checkpoints
# that do not fit go to /kaggle/temp, which is not kept: the session publishes from there.
OUTPUT_LIMIT_BYTES = 20 * 10**9
# Upload rate assumed for sizing the publish margin of large checkpoints (not measured on Kaggle).
ASSUMED_UPLOAD_BYTES_PER_S = 10 * 10**6
# Train sessions this long or longer also publish a checkpoint midway (ChainConfig.midway_publish_s): a kill before
# their end would otherwise lose hours. Shorter ones (the demo's, a smoke) have little to lose and publish once.
MIDWAY_PUBLISH_MIN_S = 3600.0
# A train session's start-up on a TPU, to the end of its first step, by part: what a fixed-length session's
# startup_margin_s must cover (ChainConfig, SMOKE_DEFAULTS), as its deadline, the limit less publishing, counts
# from the process's start. The attention probes' whole budget (PROBE_BUDGET_S, shared/runtime/attention_probe.py);
# gpt2's step compile at the slow end of the 70-145 s libtpu took for it (docs/tpu-throughput.md section 10, "What
# the compiler needed": a 2-core machine; on a TPU host not measured); the baseline eval's graphs (validation and
# HellaSwag forwards, the sample's decode step: not measured on a TPU; each a forward without the step's backward
# and optimizer, so the step's 145 s is taken for them together); and the rest: imports 3.9 s, runtime and model
# 4.4 s and a checkpoint's load 2.1 s measured (docs/tpu-throughput.md section 4), PJRT's start, W&B's and the
# bootstrap's installs and fetch not measured (docs/kaggle-tpu.md section 7, "Start-up margin").
TPU_STARTUP_S = {"attention probes": 900.0, "step compile": 145.0, "baseline eval": 145.0, "the rest": 120.0}
TPU_STARTUP_MARGIN_S = sum(TPU_STARTUP_S.values())  # 1,310 s



def session_devices(shape: str, backend: str = "auto") -> int:
    """Devices a session's trainer splits its micro-batch over: 8 on a TPU board (v5e-8, v6e-8; a v3-8's 4 chips
    are 8 cores) and on a CPU machine, whose XLA backend stands in with 8 devices (shared/tpu.py
    default_xla_env); one GPU (a kernel runs one process, no torchrun); one with backend cpu."""
    if backend == "cpu" or (backend in ("auto", "cuda") and MACHINE_SHAPES.get(shape) == "gpu"):
        return 1
    return 8
