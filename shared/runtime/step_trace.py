"""The session's optimizer step traced for a TPU's compiler, never run: `trace_step(cfg, "v5e")` builds the step as
a session on that TPU would (shared.runtime.step: the micro-batch `auto` picks there, accumulation loop, activation
checkpointing, scan, optimizer, fsdp) on torch_xla's SPMD CPU devices, with every parameter and optimizer state a
placeholder (device data with no buffer: gpt2-xl's 18 GB of state is never allocated), and returns the step's HLO
module (before optimization, shardings on its parameters) with what the compiler needs beside it.

Run in a process whose torch_xla has as many CPU devices as the TPU has chips (`PJRT_DEVICE=CPU
CPU_NUM_DEVICES=8`): `python -m shared.runtime.step_trace SETTINGS.json OUT_DIR TPU` (scripts/tpu_compile.py does).
Attention is the first kernel a session on that TPU tries at the step's sequence length for the settings'
`attention` (shared/model/attention.py, which the session asks too), as it runs when its probe passes: jax's
splash attention (through call_jax, with torchax), else torch_xla's Pallas flash-attention kernel, where the
generation compiles them, their blocks tile the sequence and jax is here (lowered by jax for the TPU platform,
which this process does not have: `lower_pallas_for_tpu`), else SDPA. A step no session runs is not traced:
gpt2-demo's 32 tokens, which neither kernel tiles, trace SDPA. `"attention": "flash"` traces the step a failed
splash probe falls back to, and `"attention": "sdpa"` the SDPA step.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shared.config import TrainConfig
from shared.model.attention import AttentionChoice
from shared.runtime.mosaic_version import pin_version as pin_mosaic_version
from shared.runtime.xla_runtime import XlaRuntime

HLO_FILE, SPEC_FILE = "step.hlo.pb", "step.json"
MOSAIC_VERSION_ENV = "GPT2K_MOSAIC_VERSION"


def hlo_sharding(spec: tuple, mesh_size: int) -> str:
    """An HLO sharding string for a partition spec over the 1-D ("data",) mesh: one sharded dimension or none."""
    if "data" not in spec:
        return "{replicated}"
    tiles = ",".join(str(mesh_size) if axis == "data" else "1" for axis in spec)
    return "{devices=[" + tiles + "]" + ",".join(str(d) for d in range(mesh_size)) + "}"


class TraceRuntime(XlaRuntime):
    """The XLA runtime with the step's state as placeholders, laid out as the session lays it out, on a named TPU
    generation: records each input's (shape, dtype, sharding) for the compiler, and never runs a graph that reads
    a placeholder."""

    def __init__(self, generation: str):
        super().__init__()
        from shared.tpu import TPU_GENERATIONS

        self.tpu_generation, self.tpu_generation_source = TPU_GENERATIONS[generation], "the compile target"
        self.inputs: list[dict] = []
        self._placeholders: set[int] = set()

    def select_attention(self, batch: int, n_head: int, seq_len: int, head_dim: int, setting: str = "auto",
                         batch_for: Callable[[str], int] | None = None) -> AttentionChoice:
        """The first kernel a session on this TPU tries at `seq_len` for `setting`, by the session's own loop
        (shared/model/attention.py `choose`) without its probe (which runs the kernel): a kernel whose jax or
        torchax does not import here gives way to the next, as in a session."""
        from shared.model.attention import candidates, choose
        from shared.runtime.attention_select import make_kernel

        chosen = choose(candidates(self.tpu_generation.name, seq_len, setting), (batch, n_head, seq_len, head_dim),
                        lambda kind, instead: make_kernel(self.mesh, kind, instead))
        if chosen.kernel is not None:
            lower_pallas_for_tpu()
        return chosen

    def _record(self, tensor: torch.Tensor, spec: tuple) -> None:
        self.inputs.append({"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                            "sharding": hlo_sharding(spec, self.num_devices)})

    def _placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        from torch_xla.core import xla_builder

        tensor = xla_builder.create_placeholder_tensor(shape, dtype)
        self._placeholders.add(id(tensor))
        return tensor

    def place(self, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        placed = self._placeholder(tensor.shape, tensor.dtype)
        self._record(placed, self._param_spec(like))
        return placed

    def shard_like(self, tensor: torch.Tensor, param: torch.Tensor) -> None:
        if id(tensor) not in self._placeholders:  # a real (small) tensor: laid out as the session lays it out
            super().shard_like(tensor, param)
        self._record(tensor, self._param_spec(param))

    def batch_to_device(self, batch: np.ndarray, batch_dim: int = 0) -> torch.Tensor:
        tensor = super().batch_to_device(batch, batch_dim)
        self._record(tensor, tuple("data" if d == batch_dim else None for d in range(tensor.dim())))
        return tensor

    def prepare_model(self, model: torch.nn.Module, fsdp: bool, compile: bool = False,
                      activation_checkpointing: bool = False, scan_layers: bool = False) -> torch.nn.Module:
        """`model` (built on the meta device) with placeholder parameters, tied ones still tied."""
        swapped: dict[int, torch.nn.Parameter] = {}
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    if id(param) not in swapped:
                        placeholder = torch.nn.Parameter(self._placeholder(param.shape, param.dtype),
                                                         requires_grad=param.requires_grad)
                        self._placeholders.add(id(placeholder))
                        swapped[id(param)] = placeholder
                    module._parameters[name] = swapped[id(param)]
        model.vocab_padding = model.vocab_padding_mask(self.device)
        return super().prepare_model(model, fsdp, compile, activation_checkpointing, scan_layers)


def lower_pallas_for_tpu() -> None:
    """Make torch_xla lower its Pallas kernels for the TPU platform, here where jax's backend is the CPU.

    torch_xla's `trace_pallas` (torch_xla/experimental/custom_kernel.py, 2.8.0 and 2.9.0) lowers a kernel with
    `jax.jit(kernel).lower(...)` on jax's default backend, and the Mosaic lowering is registered for TPU only.
    `jit(...).trace(...).lower(lowering_platforms=("tpu",))` gives the same Mosaic payload a TPU host would, which
    the tpu_custom_call node carries to the TPU compiler. Only in this process, which never runs the step.
    Here jax has no TPU backend to pick the Mosaic version from: its latest, unless MOSAIC_VERSION_ENV names the
    one the target's libtpu reads (as a session pins it after its probe, shared/runtime/mosaic_version.py)."""
    import torch_xla.experimental.custom_kernel as custom_kernel

    if os.environ.get(MOSAIC_VERSION_ENV):  # the version the target's libtpu reads (scripts/tpu_compile.py)
        pin_mosaic_version(int(os.environ[MOSAIC_VERSION_ENV]))

    def trace_pallas(kernel, *args, static_argnums=None, static_argnames=None, use_cache=False, **kwargs):
        import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401  (registers the Mosaic lowering)

        jax_args = [custom_kernel.to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a for a in args]
        traced = jax.jit(kernel, static_argnums=static_argnums, static_argnames=static_argnames).trace(
            *jax_args, **kwargs)
        ir = traced.lower(lowering_platforms=("tpu",)).compiler_ir()
        return custom_kernel._extract_backend_config(ir), [a for a in args if torch.is_tensor(a)]

    custom_kernel.trace_pallas = trace_pallas
    _lower_call_jax_for_tpu()


def _lower_call_jax_for_tpu() -> None:
    """The same for torch_xla's `call_jax` (torch_xla/core/xla_builder.py `JaxCallable.specialize`, 2.8.0 and
    2.9.0), through which jax's splash attention comes (shared/model/splash.py): its function lowered for the TPU
    platform, the rest as torch_xla does it."""
    import torch_xla.core.xla_builder as xb
    from jax.experimental.pallas import tpu as _pallas_tpu  # noqa: F401  (before the registration: import order)

    def specialize(self, sample_flat_args):
        import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401  (registers the Mosaic lowering)

        mapping = xb.maybe_get_torchax().ops.mappings
        sample = tuple(jax.ShapeDtypeStruct(a.shape, mapping.t2j_dtype(a.dtype)) if a is not None else None
                       for a in sample_flat_args)
        traced = jax.jit(self._flat_input_func.flat_call, keep_unused=True).trace(sample)
        module = traced.lower(lowering_platforms=("tpu",)).compiler_ir("hlo").as_serialized_hlo_module_proto()
        return xb.xla_computation_as_func(xb.computation_from_module_proto("jax_callable", module), "jax_func")

    xb.JaxCallable.specialize = specialize


def trace_step(cfg: TrainConfig, generation: str) -> tuple[bytes, dict]:
    """The HLO module (serialized HloModuleProto) of one optimizer step of `cfg` as a session on TPU `generation`
    runs it, and what the compiler needs beside it: each input's shape, dtype and sharding, the outputs that
    update an input in place (donated, as torch_xla donates them), and the settings the step was built with."""
    import torch_xla

    from shared.model.model import GPT
    from shared.runtime.step import build_step, select_attention_and_micro_batch

    runtime = TraceRuntime(generation)
    cfg.validate(runtime.num_devices)
    cfg, attention = select_attention_and_micro_batch(cfg, runtime, log=lambda _: None)
    with torch.device("meta"):
        model = GPT(cfg.model.shape, attention)
    step = build_step(cfg, runtime, model, attention.kind, start_step=1)
    state = step.state_tensors()
    tokens = np.zeros((cfg.grad_accum_steps, cfg.step.micro_batch, cfg.model.shape.block_size + 1), dtype=np.int32)
    loss, grad_norm, lr = step(tokens)
    outputs = state + [loss, grad_norm, lr]
    proto = torch_xla._XLAC._get_xla_tensors_hlo_proto(outputs)
    meta = {"inputs": runtime.inputs, "updated_outputs": len(state), "num_devices": runtime.num_devices,
            "micro_batch": cfg.step.micro_batch, "grad_accum_steps": cfg.grad_accum_steps, "attention": attention.kind,
            "accum_loop": step.plan.accum_loop, "activation_checkpointing": step.plan.activation_checkpointing,
            "scan_layers": step.plan.scan_layers, "num_params": cfg.model.shape.num_params(),
            "train": cfg.to_dict()}
    return proto, meta


def main(argv: list[str]) -> None:
    settings_path, out_dir, generation = argv
    cfg = TrainConfig.from_dict(json.loads(Path(settings_path).read_text()))
    proto, meta = trace_step(cfg, generation)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / HLO_FILE).write_bytes(proto)
    (out / SPEC_FILE).write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    from shared.errors import run_cli

    run_cli(lambda: main(sys.argv[1:]))
