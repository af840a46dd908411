"""The torch_xla SPMD runtime (a TPU, or torch_xla's CPU devices): one 1-D mesh, batches sharded on it, the
step traced once and compiled; with its helpers for torch_xla's scan over the block stack and the count of
explicit device waits. torch_xla is imported only when an `XlaRuntime` is made, so importing this stays cheap.
Which TPU a host has (generation, peaks, PCI probe) is `shared.tpu`."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import numpy as np
import torch

from shared.model.attention import AttentionChoice
from shared.runtime.attention_select import select_on_mesh
from shared.runtime.runtime import Runtime
from shared.runtime.xla_notices import quiet_known_messages
from shared.tpu import TPU_GENERATIONS, default_xla_env, detect_tpu_generation


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
        self.tpu_generation, self.tpu_generation_source = None, ""
        # The hardware the runtime's own client reports for its devices ("TPU", "CPU"): xr.device_type() only
        # echoes the PJRT_DEVICE setting (torch_xla/runtime.py `device_type`), which a session's device check
        # must not take on trust.
        import torch_xla.core.xla_model as xm

        self._hardware = xm.xla_device_hw(self.device)
        if self._hardware == "TPU":
            self._detect_tpu_generation()

    @property
    def lookup_grad_columns(self) -> bool:
        """Whether the token lookup's gradient is scattered into (C, V) columns and transposed (GPT's
        `embedding_grad_apart`): where a TPU's compiler reads the step (on a TPU, or tracing for one), which then
        all-reduces it once after the accumulation loop. XLA:CPU moves no all-reduce out of a loop, and there the
        transpose only costs: a 6-step tiny run of kernels/train.py took 16% less CPU without it
        (docs/tpu-throughput.md)."""
        return self._hardware != "CPU" or self.tpu_generation is not None

    @property
    def description(self) -> str:
        kind = f" {self.tpu_generation.name}" if self.tpu_generation else ""
        return f"xla:{self.device_type}{kind} x{self.num_devices} (SPMD)"

    @property
    def device_type(self) -> str:
        return self._hardware

    def _detect_tpu_generation(self) -> None:
        from torch_xla._internal import tpu

        try:
            attributes = dict(self._xr.global_runtime_device_attributes()[0])
        except Exception:  # the attribute API has changed across versions; the other sources suffice
            attributes = {}
        name, self.tpu_generation_source = detect_tpu_generation(device_attributes=attributes,
                                                                 tpu_type=tpu.get_tpu_type)
        self.tpu_generation = TPU_GENERATIONS.get(name or "")

    def select_attention(self, batch: int, n_head: int, seq_len: int, head_dim: int, setting: str = "auto",
                         batch_for: Callable[[str], int] | None = None) -> AttentionChoice:
        """The attention for these shapes: the Pallas kernels over this mesh, each probed once at the micro-batch it
        would train at (`batch_for`), within the session's budget (shared/runtime/attention_select.py); kept nowhere
        here, the session gives it to its model and its step."""
        return select_on_mesh(self, batch, n_head, seq_len, head_dim, setting, batch_for)

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
        micro-steps run as an XLA While loop over their first dimension (`shared.runtime.accum_loop`: traced on the
        first step, no device wait).
        accum_loop=False: one graph per micro-step, each micro-batch sent on its own (the earlier structure)."""
        accum = tokens.shape[0]
        if accum == 1 or not accum_loop:
            return super().forward_backward(model, tokens, bf16, scaler)
        tokens_on_device = self.batch_to_device(tokens, batch_dim=1)

        def micro_step(batch: torch.Tensor) -> torch.Tensor:
            with self.autocast(bf16):
                return model(batch[:, :-1], batch[:, 1:])[1]

        # It divides each micro-step's loss by accum and sums: the returned loss is the step's mean. The loop is
        # traced on the first step and reused after; it is kept per model and autocast setting.
        if self._accum_loop is None or self._accum_loop[:2] != (model, bf16):
            from shared.runtime.accum_loop import AccumulationLoop

            apart = getattr(model, "embedding_grad_apart", None)
            loop = AccumulationLoop(micro_step, list(model.parameters()), place_slice=self.shard_batch,
                                    grad_apart=apart and functools.partial(apart, columns=self.lookup_grad_columns))
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

    @property
    def shards_parameters(self) -> bool:
        return self._fsdp

    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """The graph gathers `tensor` onto every device (GSPMD inserts the gather where the annotation asks for the
        whole tensor): reading a sharded tensor on the host would compile a replication program at every read
        (batch-sharded results, FSDP-sharded parameters)."""
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
    """Explicit waits for the device (torch_xla's `wait_device_ops`, as `xm.wait_device_ops` calls it) since the
    first call, which installs the counting wrapper."""
    import torch_xla

    wait = torch_xla._XLAC._xla_wait_device_ops
    if not getattr(wait, "counted", False):
        def counted_wait(*args, **kwargs):
            _device_waits[0] += 1
            return wait(*args, **kwargs)

        counted_wait.counted = True
        torch_xla._XLAC._xla_wait_device_ops = counted_wait  # xm.wait_device_ops looks it up at each call
    return _device_waits[0]
