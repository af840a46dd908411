"""The optimizer step a session runs, built once: how it runs on this runtime (StepPlan), the model laid out on the
devices, the schedule's scalars on the device, the optimizer with its state, and the step itself as one call. The
trainer calls it in its loop; `shared.runtime.step_trace` traces the same step for a TPU compiler without running it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.config import AUTO, TrainConfig
from shared.errors import UserError
from shared.model.attention import SDPA, AttentionChoice
from shared.runtime.optim import clip_grad_norm, lr_at, make_optimizer, muon_momentum_at
from shared.runtime.runtime import Runtime
from shared.tpu import activation_checkpointing_on, micro_batch_for


@dataclass(frozen=True)
class StepPlan:
    """How a step runs on this runtime, with `auto` settings resolved (logged at the session start)."""

    accum_loop: bool
    activation_checkpointing: bool
    scan_layers: bool
    attention: str = SDPA  # the kernel the session's selection chose (AttentionChoice.kind)

    def describe(self, runtime: Runtime, accum: int) -> str:
        loop = ("one graph per step (micro-steps in an XLA loop)" if self.accum_loop else
                "one graph per micro-step" if accum > 1 else "one micro-step per step")
        return (f"step: {loop if runtime.name == 'xla' else f'{accum} micro-step(s)'}; attention {self.attention}; "
                f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}; "
                f"scan over layers {'on' if self.scan_layers else 'off'}")


def plan_step(cfg: TrainConfig, runtime: Runtime, attention: str = SDPA,
              scan_available: bool | None = None) -> StepPlan:
    """Resolve the step settings for this runtime and `attention`, the kernel the session chose. Under XLA a step of
    several micro-steps is one graph (the micro-steps in an XLA loop) unless --no-grad-accum-loop. `auto` turns
    activation checkpointing on where the TPU's memory needs it (gpt2-medium and up on 16 GB devices, gpt2-large
    and up on 32 GB ones), and the scan over layers on for 24+ layers (gpt2-medium up; for gpt2's 12 it compiled
    slower on the XLA CPU compiler: docs/tpu-throughput.md) on a TPU running SDPA attention (the Pallas kernel is
    untested inside scan) when the step has no accumulation loop: inside torch_xla 2.9's loop the scan computed
    wrong losses (tests/train/test_train.py shows it), so the two are never combined."""
    from shared.runtime.xla_runtime import scan_layers_available

    n_layer, gen, xla = cfg.model.shape.n_layer, runtime.tpu_generation, runtime.name == "xla"
    loop = cfg.step.grad_accum_loop and xla and cfg.grad_accum_steps > 1
    checkpointing = activation_checkpointing_on(cfg.step.activation_checkpointing, n_layer, gen.name if gen else None)
    wanted = cfg.step.scan_layers == "on" or (cfg.step.scan_layers == "auto" and xla and bool(gen) and n_layer >= 24)
    if scan_available is None:  # asked only where the scan could run: it imports jax into this process
        scan_available = wanted and xla and scan_layers_available()
    if cfg.step.scan_layers == "on" and not (xla and scan_available):
        raise UserError("--scan-layers on needs the xla backend with jax and torchax importable by torch_xla "
                        f"(backend {runtime.name}, jax+torchax {'working' if scan_available else 'not importable'})")
    if cfg.step.scan_layers == "on" and loop:
        raise UserError("--scan-layers on computes wrong losses inside torch_xla's gradient-accumulation loop; "
                        "add --no-grad-accum-loop (a graph per micro-step), or use one micro-step per step")
    if cfg.step.scan_layers == "auto":
        scan = wanted and scan_available and attention == SDPA and not loop
    else:
        scan = cfg.step.scan_layers == "on"
    return StepPlan(accum_loop=loop, activation_checkpointing=checkpointing, scan_layers=scan, attention=attention)


def select_attention_and_micro_batch(cfg: TrainConfig, runtime: Runtime, log=print,
                                     chosen: AttentionChoice | None = None) -> tuple[TrainConfig, AttentionChoice]:
    """The attention kernel for this model's shapes (on a TPU the Pallas kernel is probed at them); with
    `--micro-batch auto`, each kernel probed once at the micro-batch it and this TPU allow, the one the session
    then trains at: the config the session trains with, and the attention its model and step are given.
    `chosen`: an attention already chosen (a test's), which is not selected again."""
    m = cfg.model.shape
    shape = (m.n_head, m.block_size, m.n_embd // m.n_head)
    if cfg.step.micro_batch != AUTO:
        return cfg, chosen or runtime.select_attention(cfg.step.micro_batch, *shape, cfg.step.attention)
    generation = runtime.tpu_generation.name if runtime.tpu_generation else None

    def batch_for(kind: str) -> int:
        return micro_batch_for(cfg, generation, kind, runtime.num_devices)

    attention = chosen or runtime.select_attention(batch_for(SDPA), *shape, cfg.step.attention, batch_for=batch_for)
    micro_batch = batch_for(attention.kind)
    log(f"micro-batch auto: {micro_batch} ({micro_batch // runtime.num_devices} a device; TPU {generation or 'none'}, "
        f"{attention.kind} attention)")
    return cfg.replace(micro_batch=micro_batch), attention


@dataclass
class TrainStep:
    """One optimizer step, `step(tokens)` with tokens (accum, micro_batch, T+1): the micro-steps' gradients, clipping,
    the LR (and Muon's momentum) of this step set on the device, the update; returns (loss, grad_norm, lr) as device
    tensors. `model` is what the step calls (a DDP or torch.compile wrapper, or the model itself)."""

    cfg: TrainConfig
    runtime: Runtime
    plan: StepPlan
    model: torch.nn.Module
    named_params: list[tuple[str, torch.nn.Parameter]]
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    step_t: torch.Tensor  # the schedule's step, on the device
    lr_t: torch.Tensor
    momentum_t: torch.Tensor | None

    def __call__(self, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, opt, scaler = self.cfg, self.opt, self.scaler
        loss = self.runtime.forward_backward(self.model, tokens, cfg.step.bf16, scaler, self.plan.accum_loop)
        scaler.unscale_(opt)
        grad_norm = clip_grad_norm([p for _, p in self.named_params], cfg.optim.grad_clip)
        # a fresh tensor each step: the logging thread reads it after lr_t moved on
        lr = lr_at(self.step_t, cfg.optim, cfg.lr_schedule)
        self.lr_t.copy_(lr)
        if self.momentum_t is not None:
            self.momentum_t.copy_(muon_momentum_at(self.step_t, cfg.optim))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        self.step_t += 1
        return loss, grad_norm, lr

    def state_tensors(self) -> list[torch.Tensor]:
        """Every device tensor a step updates: the parameters, the optimizer's state and the schedule's scalars."""
        tensors = [p for _, p in self.named_params]
        tensors += [t for _, p in self.named_params for t in self.opt.state[p].values() if isinstance(t, torch.Tensor)]
        return tensors + [t for t in (self.step_t, self.lr_t, self.momentum_t) if t is not None]


def build_step(cfg: TrainConfig, runtime: Runtime, model: torch.nn.Module, attention: str, start_step: int,
               saved_optimizer: dict[str, torch.Tensor] | None = None) -> TrainStep:
    """The session's step for `model` (on the CPU, initialised or loaded, built with the `attention` kernel the
    session chose): laid out on the runtime's devices as the
    plan says, the schedule's scalars at `start_step` on the device, the optimizer with its state (zeros, or
    `saved_optimizer`), all materialised as device data before the first step."""
    plan, optim = plan_step(cfg, runtime, attention), cfg.optim
    step_model = runtime.prepare_model(model, cfg.step.fsdp, cfg.step.compile, plan.activation_checkpointing,
                                       plan.scan_layers)
    step_t = torch.tensor(float(start_step)).to(runtime.device)
    lr_t = lr_at(step_t, optim, cfg.lr_schedule)
    # Muon's momentum moves with the step only while it warms up; otherwise it stays a constant in the graph.
    warms_up = optim.optimizer == "muon" and optim.muon_momentum_warmup_steps
    momentum_t = muon_momentum_at(step_t, optim) if warms_up else None
    for scalar in (step_t, lr_t, momentum_t):
        if scalar is not None:
            runtime.shard_like(scalar, scalar)
    runtime.sync()  # AdamW's constructor reads the LR's value once; let it read device data
    named_params = list(model.named_parameters())
    opt = make_optimizer(named_params, optim, runtime, lr_t, saved_optimizer, momentum_t)
    scaler = runtime.grad_scaler(cfg.step.bf16)  # active only for fp16 autocast (GPUs without bf16)
    runtime.sync()  # materialise params and optimizer state as device data before the first step
    return TrainStep(cfg, runtime, plan, step_model, named_params, opt, scaler, step_t, lr_t, momentum_t)
