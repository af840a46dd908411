"""Where the math runs, in plain torch: `Runtime` (one device, CPU or CUDA), the interface every runtime keeps so
the training loop reads the same on every backend, and `DdpRuntime` (torchrun's processes under DDP). The XLA
runtime is `shared.runtime.xla_runtime`; `shared.runtime.device.make_runtime` picks one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import numpy as np
import torch

from shared.model.attention import SDPA_CHOICE, AttentionChoice
from shared.tpu import TpuGeneration

# bf16 peak FLOP/s per GPU, matched against torch.cuda.get_device_name.
PEAK_BF16_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
    "T4": 65e12,  # fp16 tensor cores; no bf16
    "P100": 18.7e12,  # fp16
}


class Runtime:
    """Plain torch on one device (CPU or one GPU); `XlaRuntime` overrides what differs under XLA."""

    name = "torch"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.num_devices = 1

    @property
    def description(self) -> str:
        return f"{self.device.type} x{self.num_devices}"

    @property
    def device_type(self) -> str:
        """What the math runs on, as torch_xla names it: "TPU", "CPU", "CUDA"."""
        return self.device.type.upper()

    is_main = True  # the process that writes checkpoints and logs

    @property
    def amp_dtype(self) -> torch.dtype:
        """bf16 where the device has it; fp16 (with a gradient scaler) on GPUs without it (T4, P100)."""
        if self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16

    def autocast(self, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def grad_scaler(self, enabled: bool) -> torch.amp.GradScaler:
        """A loss scaler for fp16 autocast; everywhere else a disabled one, which passes everything through."""
        return torch.amp.GradScaler("cuda", enabled=enabled and self.amp_dtype == torch.float16)

    tpu_generation: TpuGeneration | None = None  # set on a TPU whose generation is known
    tpu_generation_source = ""  # where the generation was read, or what was seen instead
    def select_attention(self, batch: int, n_head: int, seq_len: int, head_dim: int, setting: str = "auto",
                         batch_for: Callable[[str], int] | None = None) -> AttentionChoice:
        """The attention for a model of these shapes, `batch` sequences per micro-step over all devices (the session
        asks once the model config is known, before the model is built, and gives the choice to its model and its
        step; no runtime keeps it); `setting`: TrainConfig.attention, the kernel to start from. `batch_for(kind)`:
        the micro-batch each kernel would train at (`--micro-batch auto`), which its one probe runs at instead of
        `batch`. Which kernels, and the loop that tries them, are shared/model/attention.py's (`candidates`,
        `choose`); here, without a TPU, it is SDPA alone."""
        return SDPA_CHOICE

    def no_grad_sync(self, model: torch.nn.Module, skip: bool):
        """Inside gradient accumulation, skip the cross-process gradient reduction (DDP only)."""
        return contextlib.nullcontext()

    def mean_across(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of a per-process scalar over all processes (SPMD and single-process values are global)."""
        return tensor

    def barrier(self) -> None:
        """Wait for every process (DDP only)."""

    def batch_to_device(self, batch: np.ndarray, batch_dim: int = 0) -> torch.Tensor:
        return torch.from_numpy(batch).to(self.device)

    def forward_backward(self, model: torch.nn.Module, tokens: np.ndarray, bf16: bool, scaler,
                         accum_loop: bool = True) -> torch.Tensor:
        """Gradients of one optimizer step accumulated into the parameters' .grad, from `tokens` of shape
        (micro-steps, B, T+1); returns the step's mean loss (detached). Here: one micro-batch at a time."""
        accum = tokens.shape[0]
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(accum):
            batch = self.batch_to_device(tokens[micro])
            with self.no_grad_sync(model, skip=micro < accum - 1):
                with self.autocast(bf16):
                    _, loss = model(batch[:, :-1], batch[:, 1:])
                loss = loss / accum
                loss_sum += loss.detach()
                scaler.scale(loss).backward()
            if micro < accum - 1:
                self.sync()  # XLA without the loop: a graph per micro-step keeps memory to one micro-batch
        return loss_sum

    def prepare_model(self, model: torch.nn.Module, fsdp: bool, compile: bool = False,
                      activation_checkpointing: bool = False, scan_layers: bool = False) -> torch.nn.Module:
        """Move `model` (in place) to the device; return the module the training step should call.
        activation_checkpointing: recompute each block's activations in the backward pass instead of keeping
        them; scan_layers: XLA only (compile one block for the whole stack)."""
        model.to(self.device)
        if activation_checkpointing:
            from torch.utils.checkpoint import checkpoint

            model.block_checkpoint = lambda block, x: checkpoint(block, x, use_reentrant=False)
        if compile and self.device.type == "cuda":
            return torch.compile(model)
        return model

    def shard_like(self, tensor: torch.Tensor, param: torch.Tensor) -> None:
        """Give `tensor` (an optimizer state) the same layout as `param`."""

    def place(self, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """`tensor` (on the CPU) on the device, laid out as `like` (an optimizer state as its parameter)."""
        placed = tensor.to(self.device)
        self.shard_like(placed, like)
        return placed

    shards_parameters = False  # whether prepare_model laid the parameters out in shards over the devices (fsdp)

    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` laid out whole on every device (a no-op where nothing is sharded): the optimizer's update of a
        sharded matrix, a sampled token or a HellaSwag score read on the host."""
        return tensor

    def sync(self) -> None:
        """End of a step: XLA cuts and runs the graph here; eager torch has nothing to do."""

    def add_step_closure(self, fn: Callable, args: tuple = ()) -> None:
        fn(*args)

    def compile_count(self) -> int:
        return 0

    def execution_count(self) -> int:
        """Compiled graphs launched so far (XLA; 0 where the backend does not count them)."""
        return 0

    def compile_seconds(self) -> float:
        """Seconds spent compiling graphs so far in this process."""
        return 0.0

    def compile_cache_stats(self) -> dict:
        """Persistent compilation cache lookups so far: found and loaded, found but not loadable, not found."""
        return {}

    def transfer_counts(self) -> tuple[int, int]:
        """(host-to-device, device-to-host) transfers so far, where the backend counts them."""
        return (0, 0)

    def device_timers(self) -> dict[str, float]:
        """Running totals, where the backend measures them (XLA; empty elsewhere): `execute_s`, seconds the device
        ran graphs (launch to results ready); `device_waits`, explicit waits for the device (`wait_device_ops`,
        counted by wrapping torch_xla's)."""
        return {}

    def peak_flops(self) -> float | None:
        """bf16 peak FLOP/s of all devices together, or None where MFU would be meaningless (CPU)."""
        if self.device.type != "cuda":
            return None
        name = torch.cuda.get_device_name(self.device)
        per = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
        return per * self.num_devices if per else None

    def rng_state(self) -> dict:
        return {"torch_cpu": torch.get_rng_state().tolist()}

    def set_rng_state(self, state: dict) -> None:
        if "torch_cpu" in state:
            torch.set_rng_state(torch.tensor(state["torch_cpu"], dtype=torch.uint8))


class DdpRuntime(Runtime):
    """torchrun's processes, one device each (GPUs, or CPUs with gloo for tests), under DistributedDataParallel.

    Every process reads the same global batch and keeps its own rows, so N processes see exactly the data that
    one process with the same total batch sees, and the averaged gradients are the same.
    """

    name = "ddp"

    def __init__(self, device_type: str):
        import torch.distributed as dist

        self._dist = dist
        cuda = device_type == "cuda"
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        self.rank, self.num_devices = dist.get_rank(), dist.get_world_size()
        self.is_main = self.rank == 0
        self.device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        self._device_ids = [local_rank] if cuda else None

    @property
    def description(self) -> str:
        return f"ddp:{self.device.type} x{self.num_devices}"

    def batch_to_device(self, batch: np.ndarray, batch_dim: int = 0) -> torch.Tensor:
        rows = batch.shape[batch_dim] // self.num_devices
        mine = np.take(batch, np.arange(self.rank * rows, (self.rank + 1) * rows), axis=batch_dim)
        return torch.from_numpy(mine).to(self.device)

    def prepare_model(self, model: torch.nn.Module, fsdp: bool, compile: bool = False,
                      activation_checkpointing: bool = False, scan_layers: bool = False) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        step_model = super().prepare_model(model, fsdp, compile, activation_checkpointing)
        return DistributedDataParallel(step_model, device_ids=self._device_ids)

    def no_grad_sync(self, model: torch.nn.Module, skip: bool):
        return model.no_sync() if skip else contextlib.nullcontext()

    def mean_across(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().clone()
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.SUM)
        return tensor / self.num_devices

    def barrier(self) -> None:
        self._dist.barrier()


def runtime_versions() -> dict[str, str | None]:
    """Python, torch, torch_xla, jax, jaxlib, libtpu and torchax as installed (None: absent), read without importing
    jax; and the Mosaic version this process lowers Pallas kernels at ("mosaic": pinned, or jax's own choice at
    its last lowering; None before any, shared/runtime/mosaic_version.py)."""
    import platform
    from importlib import metadata

    from shared.runtime.mosaic_version import version_in_use

    def version(*dists: str) -> str | None:
        for dist in dists:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
        return None

    return {"python": platform.python_version(), "torch": torch.__version__, "torch_xla": version("torch_xla"),
            "jax": version("jax"), "jaxlib": version("jaxlib"), "libtpu": version("libtpu", "libtpu-nightly"),
            "torchax": version("torchax") or module_version("torchax"), "mosaic": version_in_use()}


def module_version(name: str) -> str | None:
    """A module's own `__version__`, where no package metadata names it: torch_xla 2.8.0's wheel carries a torchax of
    its own (`__version__ = "0.0.4"`, in its RECORD, with no dist-info). Read from the module where it is imported,
    else from its source without importing it (importing torchax imports jax, which on a TPU must wait for
    torch_xla's runtime); None where there is no such module or line."""
    import importlib.util
    import re
    import sys

    if name in sys.modules:
        found = getattr(sys.modules[name], "__version__", None)
        return str(found) if found else None
    try:
        spec = importlib.util.find_spec(name)
        source = open(spec.origin).read() if spec and spec.origin else ""
    except (ImportError, ValueError, OSError):
        return None
    line = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", source, re.MULTILINE)
    return line.group(1) if line else None


def plan_versions_notice(versions: dict[str, str | None]) -> str | None:
    """One line where this session's jax, jaxlib or libtpu is not what `--plan` compiled the step with
    (shared/tpu.py PLAN_TPU_VERSIONS); None where they agree."""
    from shared.tpu import PLAN_TPU_VERSIONS

    differ = [name for name, planned in PLAN_TPU_VERSIONS.items() if versions.get(name) != planned]
    if not differ:
        return None
    here = ", ".join(f"{name} {versions.get(name) or '-'}" for name in differ)
    planned = ", ".join(f"{name} {PLAN_TPU_VERSIONS[name]}" for name in differ)
    return (f"notice: this session runs {here}, where --plan compiled the step with {planned}: its compiles, "
            "memory and Mosaic version may differ from the plan's")
