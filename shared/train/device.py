"""Where the math runs: one small interface over torch_xla SPMD (TPU, or 8 virtual CPU devices) and plain
torch (CPU/CUDA), so the training loop reads the same on every backend.

torch_xla is imported only by `XlaRuntime`, so importing this module stays cheap. Which TPU a host has
(generation, peaks, PCI probe) is `shared.tpu`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import numpy as np
import torch

from shared.tpu import TPU_GENERATIONS, TpuGeneration, default_xla_env, detect_tpu_generation
from shared.train.xla_notices import quiet_known_messages

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
    attention = "sdpa"  # or "pallas-flash" where the device layer installed TPU flash attention

    def select_attention(self, batch: int, n_head: int, seq_len: int, head_dim: int) -> None:
        """Choose the attention kernel for a model of these shapes, `batch` sequences per micro-step over all
        devices (the trainer calls this once the model config is known). Here: SDPA."""

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

    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` laid out whole on every device (a no-op where nothing is sharded)."""
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


class XlaRuntime(Runtime):
    """torch_xla SPMD over every device: a 1-D mesh ('data'), batches sharded on it, params replicated
    (or sharded over it with fsdp, GSPMD inserting the gathers and reduce-scatters)."""

    name = "xla"

    def __init__(self, compile_cache: str | os.PathLike | None = None):
        default_xla_env()
        import torch_xla
        import torch_xla.distributed.spmd as xs
        import torch_xla.runtime as xr

        if compile_cache:  # compiled graphs persist here (before any computation, as torch_xla requires)
            xr.initialize_cache(str(compile_cache), readonly=False)
        quiet_known_messages()
        xr.use_spmd()
        self._xla, self._xs, self._xr = torch_xla, xs, xr
        count_device_waits()  # from here on, every wait for the device is counted
        self.device = torch_xla.device()
        self.num_devices = xr.global_runtime_device_count()
        self.mesh = xs.Mesh(np.arange(self.num_devices), (self.num_devices,), ("data",))
        self._fsdp = False
        self._accum_loop: tuple | None = None  # (model, bf16, AccumulationLoop) of the last step
        self.accum_impl = "own"  # or "torch_xla": its gradient_accumulation helper (bench_mfu --torch-xla-accum)
        self.tpu_generation, self.tpu_generation_source = None, ""
        if xr.device_type() == "TPU":
            self._detect_tpu_generation()

    @property
    def description(self) -> str:
        kind = f" {self.tpu_generation.name}" if self.tpu_generation else ""
        return f"xla:{self.device_type}{kind} x{self.num_devices} (SPMD)"

    @property
    def device_type(self) -> str:
        return self._xr.device_type()

    def _detect_tpu_generation(self) -> None:
        from torch_xla._internal import tpu

        try:
            attributes = dict(self._xr.global_runtime_device_attributes()[0])
        except Exception:  # the attribute API has changed across versions; the other sources suffice
            attributes = {}
        name, self.tpu_generation_source = detect_tpu_generation(device_attributes=attributes,
                                                                 tpu_type=tpu.get_tpu_type)
        self.tpu_generation = TPU_GENERATIONS.get(name or "")

    def select_attention(self, batch: int, n_head: int, seq_len: int, head_dim: int) -> None:
        from shared.train.model import set_attention_kernel

        set_attention_kernel(None)  # the runtime is process-wide: a previous session's choice does not carry over
        self.attention = "sdpa"
        kernel = self._flash_attention_kernel()
        if kernel is None:
            return
        # The image's jax may not be the one this torch_xla was built against (Kaggle's TPU image pairs torch_xla
        # 2.8.0 with jax 0.7.x, docs/kaggle-tpu.md), and Mosaic compiles the kernel per shape: run it forward and
        # backward at this session's own shapes, sharded as training shards them, and keep SDPA unless it runs
        # and agrees with SDPA, rather than dying (or training wrong) at the first step.
        failure = probe_attention_kernel(kernel, (batch, n_head, seq_len, head_dim), self.device,
                                         self.shard_batch, self.sync)
        if failure:
            print(f"notice: the Pallas flash-attention kernel failed its probe at this session's shapes "
                  f"({batch // self.num_devices} sequences x {n_head} heads x {seq_len} tokens x {head_dim} per "
                  f"device): {failure}; using SDPA", flush=True)
            return
        set_attention_kernel(kernel)
        self.attention = "pallas-flash"

    def _flash_attention_kernel(self) -> Callable | None:
        """torch_xla's Pallas flash attention (q, k, v) -> out over this mesh, or None where it may not run."""
        # The Pallas kernel needs jax (torch_xla[pallas]) and a generation whose Mosaic compiles it (not v2/v3);
        # on an unknown TPU, and anywhere else, SDPA (XLA's own attention) is used.
        gen = self.tpu_generation
        if not gen or not gen.pallas_flash_attention or os.environ.get("GPT2K_FLASH_ATTENTION", "1") == "0":
            return None
        try:
            import jax  # noqa: F401
            from torch_xla.experimental.custom_kernel import flash_attention
        except ImportError:
            return None
        mesh = self.mesh

        def tpu_flash_attention(q, k, v):
            return flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5,
                                   partition_spec=("data", None, None, None), mesh=mesh)

        return tpu_flash_attention

    def shard_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """A device tensor's first (batch) dimension sharded over the mesh, as `batch_to_device` lays out batches."""
        self._xs.mark_sharding(tensor, self.mesh, ("data",) + (None,) * (tensor.dim() - 1))
        return tensor

    def autocast(self, enabled: bool):
        if not enabled:
            return contextlib.nullcontext()
        return torch.autocast("xla", dtype=torch.bfloat16)

    def batch_to_device(self, batch: np.ndarray, batch_dim: int = 0) -> torch.Tensor:
        tensor = torch.from_numpy(batch).to(self.device)
        spec = tuple("data" if d == batch_dim else None for d in range(tensor.dim()))
        self._xs.mark_sharding(tensor, self.mesh, spec)
        return tensor

    def forward_backward(self, model: torch.nn.Module, tokens: np.ndarray, bf16: bool, scaler,
                         accum_loop: bool = True) -> torch.Tensor:
        """One optimizer step's gradients as one graph: the (accum, B, T+1) tokens go to the device once and the
        micro-steps run as an XLA While loop over their first dimension (`shared.train.accum_loop`: traced on the
        first step, no device wait; `accum_impl = "torch_xla"` runs torch_xla's gradient_accumulation instead).
        accum_loop=False: one graph per micro-step, each micro-batch sent on its own (the earlier structure)."""
        accum = tokens.shape[0]
        if accum == 1 or not accum_loop:
            return super().forward_backward(model, tokens, bf16, scaler)
        tokens_on_device = self.batch_to_device(tokens, batch_dim=1)

        def micro_step(batch: torch.Tensor) -> torch.Tensor:
            with self.autocast(bf16):
                return model(batch[:, :-1], batch[:, 1:])[1]

        if self.accum_impl == "torch_xla":  # torch_xla's own helper (a device wait per step), to measure against
            from torch_xla.experimental.gradient_accumulation import gradient_accumulation

            return gradient_accumulation(micro_step, (tokens_on_device,), model)
        # It divides each micro-step's loss by accum and sums: the returned loss is the step's mean. The loop is
        # traced on the first step and reused after; it is kept per model and autocast setting.
        if self._accum_loop is None or self._accum_loop[:2] != (model, bf16):
            from shared.train.accum_loop import AccumulationLoop

            loop = AccumulationLoop(micro_step, list(model.parameters()), place_slice=self.shard_batch)
            self._accum_loop = (model, bf16, loop)
        return self._accum_loop[2](tokens_on_device)

    def _param_spec(self, param: torch.Tensor) -> tuple:
        # fsdp: shard the first dimension the mesh divides; otherwise (or if none divides) replicate.
        if self._fsdp:
            for dim, size in enumerate(param.shape):
                if size % self.num_devices == 0:
                    return tuple("data" if d == dim else None for d in range(param.dim()))
        return (None,) * param.dim()

    def prepare_model(self, model: torch.nn.Module, fsdp: bool, compile: bool = False,
                      activation_checkpointing: bool = False, scan_layers: bool = False) -> torch.nn.Module:
        model.to(self.device)  # XLA traces and compiles the step itself; torch.compile is not used here
        self._fsdp = fsdp
        for param in model.parameters():
            self.shard_like(param, param)
        if activation_checkpointing:
            # torch_xla's checkpoint puts an optimization barrier around the recomputation (XLA would otherwise
            # common-subexpression it away, keeping the activations after all).
            from torch_xla.utils.checkpoint import checkpoint

            model.block_checkpoint = lambda block, x: checkpoint(block, x, use_reentrant=True)
        if scan_layers:
            model.block_stack = make_scan_layers(activation_checkpointing)
        return model

    def shard_like(self, tensor: torch.Tensor, param: torch.Tensor) -> None:
        # Replicated tensors are annotated too: a step's inputs then carry the same sharding before and after
        # the first step, so step 1 and step 2 are one graph (and a resumed run compiles that same graph).
        self._xs.mark_sharding(tensor, self.mesh, self._param_spec(param))

    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._fsdp:  # GSPMD gathers the shards where the annotation asks for the whole tensor
            self._xs.mark_sharding(tensor, self.mesh, (None,) * tensor.dim())
        return tensor

    def sync(self) -> None:
        self._xla.sync()

    def add_step_closure(self, fn: Callable, args: tuple = ()) -> None:
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn, args=args)

    def compile_count(self) -> int:
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0

    def execution_count(self) -> int:
        import torch_xla.debug.metrics as met

        # Graphs launched: every sync looks its graph up, found (CachedCompile) or compiled (UncachedCompile), then
        # launches it. Counted in the launching thread, so exact at any moment; the ExecuteReplicated counter
        # moves on the runtime's own threads, a step late or early.
        return sum(int(met.counter_value(name) or 0) for name in ("CachedCompile", "UncachedCompile"))

    def compile_seconds(self) -> float:
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return float(data[1]) / 1e9 if data else 0.0  # the accumulator is in nanoseconds

    def compile_cache_stats(self) -> dict:
        import torch_xla.debug.metrics as met

        names = {"hits": "PersistentCacheHit", "unloadable": "PersistentCacheDeserializeFailure",
                 "misses": "PersistentCacheMiss"}
        return {key: int(met.counter_value(name) or 0) for key, name in names.items()}

    def transfer_counts(self) -> tuple[int, int]:
        import torch_xla.debug.metrics as met

        to_dev, from_dev = met.metric_data("TransferToDeviceTime"), met.metric_data("TransferFromDeviceTime")
        return (int(to_dev[0]) if to_dev else 0, int(from_dev[0]) if from_dev else 0)

    def device_timers(self) -> dict[str, float]:
        import torch_xla.debug.metrics as met

        def total_s(name: str) -> float:
            data = met.metric_data(name)
            return float(data[1]) / 1e9 if data else 0.0  # accumulators are in nanoseconds

        # ExecuteReplicatedTime (SPMD) runs from the launch until the results are ready: the PJRT client releases
        # its timer in the execution's OnReady callback (pytorch/xla torch_xla/csrc/runtime/
        # pjrt_computation_client.cpp, ExecuteReplicated). (DeviceLockWait is no host-wait measure: it also sums
        # the logging thread's waits for a step's values.)
        return {"execute_s": total_s("ExecuteReplicatedTime") + total_s("ExecuteTime"),
                "device_waits": float(count_device_waits())}

    def peak_flops(self) -> float | None:
        gen = self.tpu_generation
        return gen.peak_bf16_per_device * self.num_devices if gen else None

    def rng_state(self) -> dict:
        import torch_xla.core.xla_model as xm

        return {**super().rng_state(), "xla_seed": int(xm.get_rng_state())}

    def set_rng_state(self, state: dict) -> None:
        import torch_xla.core.xla_model as xm

        super().set_rng_state(state)
        if "xla_seed" in state:
            xm.set_rng_state(int(state["xla_seed"]))


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



# How far a candidate attention kernel may be from SDPA: max |candidate - reference| over max |reference|, for the
# output and each of dq, dk, dv. The candidate runs in bf16 (8 significant bits: one rounding is up to 2^-9, 0.2%),
# the reference in fp32 from the same bf16 inputs (on a TPU its fp32 matmuls may themselves round through bf16,
# torch_xla's default precision). A correct bf16 kernel rounds several times on the way (P and dS are cast to bf16
# before their matmuls): torch's own bf16 SDPA on the CPU is within 0.7% (output, dq, dk) and 1.1% (dv) of this
# reference at gpt2-xl's heads (2 x 25 x 1024 x 64). 3e-2 leaves room for those errors plus the reference's,
# while a real fault (a gradient scaled or missing a term, no causal mask, a wrong softmax scale) is off by 10% or
# more. Normalising by the largest value, not elementwise, keeps near-zero entries (whose relative error means
# nothing) from failing a correct kernel.
ATTENTION_PROBE_TOLERANCE = 3e-2
PROBE_RESULTS = ("output", "dq", "dk", "dv")


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference attention: torch's scaled_dot_product_attention with a causal mask."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _attention_and_grads(kernel: Callable, inputs: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                         place: Callable) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of `kernel` on q, k, v (and the output's gradient) made `dtype` leaves on `device`."""
    q, k, v, grad_out = (place(t.to(device, dtype)) for t in inputs)
    for t in (q, k, v):
        t.requires_grad_()
    out = kernel(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype)))


def probe_attention_kernel(kernel: Callable, shape: tuple[int, int, int, int], device: torch.device | str = "cpu",
                           place: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
                           sync: Callable[[], None] = lambda: None,
                           tolerance: float = ATTENTION_PROBE_TOLERANCE) -> str | None:
    """Run `kernel` (q, k, v) -> causal attention forward and backward on random bf16 q, k, v of `shape` (B, H, T, D)
    on `device`, each laid out by `place` (the runtime's batch sharding), against SDPA in fp32 on the same inputs.
    None if the output and the gradients of q, k and v all agree within `tolerance`; else one line naming what
    differs, or why the kernel failed."""
    device = torch.device(device)
    try:
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(shape, generator=gen) for _ in range(4)]  # q, k, v and the output's gradient
        inputs = [t.to(torch.bfloat16) for t in inputs]  # both runs see exactly the same (bf16) values
        got = _attention_and_grads(kernel, inputs, torch.bfloat16, device, place)
        want = _attention_and_grads(sdpa_causal, inputs, torch.float32, device, place)
        errors = torch.stack([(g.float() - w).abs().max() / w.abs().max() for g, w in zip(got, want, strict=True)])
        del got, want  # under XLA the graph then returns only the four errors, not the full-size tensors
        sync()
        errors = errors.cpu().tolist()  # once, at the start of a session: a host read is fine here
    except Exception as err:  # a Mosaic/Pallas compile error, a jax/torch_xla mismatch, ...
        lines = str(err).strip().splitlines()
        return f"{type(err).__name__}: {lines[0][:200] if lines else ''}"
    # `not error <= tolerance` also fails NaN and inf (a kernel whose gradients overflow).
    bad = [f"{name} by {error:.3g}" for name, error in zip(PROBE_RESULTS, errors, strict=True)
           if not error <= tolerance]
    if bad:
        return (f"it differs from SDPA: {', '.join(bad)} (max error over SDPA's largest value; "
                f"tolerance {tolerance:g})")
    return None


def runtime_versions() -> dict[str, str | None]:
    """Python, torch, torch_xla and jax as installed (None: absent), read without importing jax."""
    import platform
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), "torch": torch.__version__, "torch_xla": version("torch_xla"),
            "jax": version("jax")}


def scan_layers_available() -> bool:
    """torch_xla's scan under SPMD calls into jax (shard_alike) through torchax: true when torch_xla's own imports
    of both succeed. (The torch_xla 2.8/2.9 wheels carry a torchax of their own that imports flax; whichever of
    it and PyPI's torchax was installed last is the one imported: scripts/setup.sh installs PyPI's last.)"""
    import importlib.util

    if any(importlib.util.find_spec(name) is None for name in ("jax", "torchax")):
        return False
    try:
        from torch_xla._internal.jax_workarounds import maybe_get_jax, maybe_get_torchax

        return maybe_get_torchax() is not None and maybe_get_jax() is not None
    except Exception:  # a broken install: no scan, rather than no training
        return False


def make_scan_layers(activation_checkpointing: bool) -> Callable:
    """A block-stack runner (blocks, x) -> x that traces and compiles one block and loops it over the stack
    (torch_xla's scan_layers); with activation checkpointing, AOTAutograd's min-cut partition recomputes what
    the backward pass needs instead of keeping it."""
    from functorch.compile import default_partition, min_cut_rematerialization_partition
    from torch_xla.experimental.scan_layers import scan_layers

    partition = min_cut_rematerialization_partition if activation_checkpointing else default_partition
    return lambda blocks, x: scan_layers(blocks, x, partition_fn=partition, is_layer_pure=True)


_device_waits = [0]


def count_device_waits() -> int:
    """Explicit waits for the device (torch_xla's `wait_device_ops`, as `xm.wait_device_ops` and torch_xla's
    gradient_accumulation call it) since the first call, which installs the counting wrapper."""
    import torch_xla

    wait = torch_xla._XLAC._xla_wait_device_ops
    if not getattr(wait, "counted", False):
        def counted_wait(*args, **kwargs):
            _device_waits[0] += 1
            return wait(*args, **kwargs)

        counted_wait.counted = True
        torch_xla._XLAC._xla_wait_device_ops = counted_wait  # xm.wait_device_ops looks it up at each call
    return _device_waits[0]


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
