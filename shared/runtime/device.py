"""Where the math runs: one small interface over torch_xla SPMD (TPU, or 8 virtual CPU devices) and plain
torch (CPU/CUDA), so the training loop reads the same on every backend. `make_runtime` picks one:
`shared.runtime.runtime` (plain torch, DDP) or `shared.runtime.xla_runtime` (torch_xla SPMD).
"""

from __future__ import annotations

import os

import torch

from shared.runtime.runtime import DdpRuntime, Runtime
from shared.runtime.xla_runtime import XlaRuntime

_xla_runtime: XlaRuntime | None = None


def make_runtime(backend: str = "auto", compile_cache: str | os.PathLike | None = None) -> Runtime:
    """`xla` (TPU, or torch_xla's CPU devices), `cuda`, `cpu`; `auto` picks xla unless a GPU is present.
    Under torchrun (WORLD_SIZE > 1), `cuda` and `cpu` run DistributedDataParallel, one process per device.
    `compile_cache` is XLA's persistent compilation cache; only the process's first XLA runtime can set it.
    A session built for a TPU whose runtime started on anything else stops here (UserError): train and eval alike."""
    from shared.kaggle.env import check_session_device

    runtime = _start_runtime(backend, compile_cache)
    check_session_device(runtime.device_type)  # a session built for a TPU trains on nothing else
    return runtime


def _start_runtime(backend: str, compile_cache: str | os.PathLike | None) -> Runtime:
    global _xla_runtime
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "xla"
    if backend == "xla":  # the XLA runtime is process-wide: one per process
        _xla_runtime = _xla_runtime or XlaRuntime(compile_cache)
        return _xla_runtime
    if backend in ("cuda", "cpu"):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # launched by torchrun
            return DdpRuntime(backend)
        return Runtime(backend)
    from shared.errors import UserError

    raise UserError(f"--backend: unknown backend {backend!r} (xla, cuda, cpu, auto)")
