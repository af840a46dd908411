"""Optimizers and learning-rate schedules, written for XLA: the LR is a device tensor the schedule computes
inside the step's graph, every state tensor exists before the first step (fixed shapes), nothing is read back.

- `adamw`: torch's AdamW (0.9/0.95, eps 1e-8), decay on 2-D weights only: the GPT-2/llm.c recipe.
- `muon`: Muon (momentum, then Newton-Schulz orthogonalisation of the update) for the 2-D weights inside the
  blocks, AdamW for the embeddings (and so the tied head), biases and LayerNorm gains (docs/recipe.md).

Schedules: `cosine` (linear warm-up, cosine to min_lr_ratio of the peak) and `wsd` (warm-up, constant, then a
decay to zero over the last `cooldown_frac` of the run, linear or 1-sqrt). A wsd run's checkpoint at the end of its
stable phase (`stable_phase_end`) is where a longer run with a later decay would be too, so --extend trains on from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from shared.config import TrainConfig
from shared.train_sections import OptimizerSettings, ScheduleSettings, saved_settings

ADAM_BETAS, ADAM_EPS = (0.9, 0.95), 1e-8
# The quintic Newton-Schulz iteration's coefficients, tuned for speed over exactness: singular values land in
# roughly [0.7, 1.2] after 5 steps, not at 1 (KellerJordan/Muon muon.py; docs/recipe.md).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5

NamedParams = list[tuple[str, torch.nn.Parameter]]


def lr_at(step: torch.Tensor, optim: OptimizerSettings, schedule: ScheduleSettings) -> torch.Tensor:
    """The AdamW learning rate at `step` (Muon's is this times muon_lr / lr).

    Tensor in, tensor out: on the device it is part of the step's graph, so a new LR is not a new graph.
    """
    step, peak, warmup, total = step.float(), optim.lr, schedule.warmup_steps, schedule.total_steps
    warm = peak * (step + 1) / max(1, warmup)
    if schedule.schedule == "wsd":
        left = ((total - step) / max(1.0, schedule.cooldown_frac * total)).clamp(0.0, 1.0)  # 1 -> 0
        decayed = peak * (left if schedule.cooldown_shape == "linear" else 1.0 - torch.sqrt(1.0 - left))
        return torch.where(step < warmup, torch.minimum(warm, decayed), decayed)  # short runs overlap
    min_lr = peak * schedule.min_lr_ratio
    progress = ((step - warmup) / max(1, total - warmup)).clamp(0.0, 1.0)
    decayed = min_lr + 0.5 * (1.0 + torch.cos(math.pi * progress)) * (peak - min_lr)
    return torch.where(step < warmup, warm, decayed)


def newton_schulz(update: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An approximately orthogonal matrix with the singular vectors of `update` (batched over leading dims):
    U S' V^T with S' near 1, where U S V^T is its SVD. Computed in `dtype` (bf16 on accelerators: the iteration
    is stable there), returned in float32."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype)
    tall = update.size(-2) > update.size(-1)
    if tall:  # iterate on the wide orientation: X X^T is the smaller square
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # Frobenius norm >= spectral norm: singular values <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if tall else x).float()


def _assign(targets: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """targets[i] <- values[i], in place (the state and parameters stay the tensors the checkpoint and the model
    hold). The optimizers compute out of place and assign once: under XLA, torch's in-place foreach ops (lerp_,
    addcmul_, addcdiv_, sqrt_, ...) run a Python meta check per tensor (torch 2.9 torch/_meta_registrations.py
    `_register_inplace_meta`), 10-20x the trace time of the out-of-place op and a copy_ (148 tensors of 768x768:
    lerp_ 22 ms, lerp + copy_ 2 ms; docs/tpu-throughput.md). Same arithmetic, so the same bits."""
    torch._foreach_copy_(targets, values)


def muon_matrix_shape(name: str, param: torch.Tensor) -> tuple[int, ...] | None:
    """How Muon sees a parameter: None for AdamW's (embeddings, biases, gains), else the shape its update is
    orthogonalised in. The fused attention input c_attn (3C x C) is three matrices, Q, K and V, each
    orthogonalised on its own (as the speedrun does, docs/recipe.md)."""
    if param.dim() != 2 or not name.startswith("transformer.h."):
        return None
    rows, cols = param.shape
    if name.endswith("attn.c_attn.weight") and rows == 3 * cols:
        return (3, cols, cols)
    return (rows, cols)


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the blocks' matrices, AdamW for every other parameter, in one optimizer (one GradScaler and one
    checkpoint layout). `lr` is the schedule's device tensor in AdamW units; a group's step size is lr * its
    `lr_ratio` (muon_lr / lr for Muon's), so one schedule drives all of them without a second tensor. With
    --matrix-lr the matrices' group is AdamW's too (kind "adam"): the AdamW control with Muon's groups.

    `replicate(t)` returns t laid out whole on every device: under fsdp each matrix is sharded over the mesh,
    and the orthogonalisation needs the whole matrix, so its update is gathered, orthogonalised redundantly on
    every device (the matrices are small next to the step's matmuls) and applied to the local shard.
    """

    def __init__(self, groups: list[dict], lr: torch.Tensor, ns_dtype: torch.dtype = torch.bfloat16,
                 replicate: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        super().__init__(groups, {"lr": lr, "weight_decay": 0.0})
        self.ns_dtype, self.replicate = ns_dtype, replicate

    @staticmethod
    def state_keys(group: dict) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["kind"] == "muon" else ("exp_avg", "exp_avg_sq", "step")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every group, traced per group rather than per parameter (under XLA every op here is
        traced from Python each step): Muon's matrices of one shape are orthogonalised as one batch, and the
        AdamW groups run in foreach calls, with the per-tensor arithmetic in the same order."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr = group["lr"] * group["lr_ratio"] if "lr_ratio" in group else group["lr"]
            if group["kind"] == "muon":
                self._muon_group(params, group, lr, group["weight_decay"])
            else:
                self._adamw_group(params, lr, group["weight_decay"])
        return None

    def _muon_group(self, params: list[torch.Tensor], group: dict, lr: torch.Tensor, wd: float) -> None:
        momentum, shapes = group["momentum"], group["shapes"]
        bufs, grads = [self.state[p]["momentum_buffer"] for p in params], [p.grad.float() for p in params]
        # Per tensor: _foreach_lerp with a device-tensor weight runs a graph of its own under SPMD.
        weight = 1 - momentum
        _assign(bufs, [buf.lerp(grad, weight) for buf, grad in zip(bufs, grads, strict=True)])
        # Nesterov: the gradient, looked ahead along the momentum
        updates = [grad.lerp(buf, momentum) for buf, grad in zip(bufs, grads, strict=True)]
        buckets: dict[tuple, list[int]] = {}
        for i, p in enumerate(params):  # matrices of one shape share one batched Newton-Schulz
            buckets.setdefault((shapes[id(p)], tuple(p.shape)), []).append(i)
        deltas: list[torch.Tensor | None] = [None] * len(params)
        for (shape, _), members in buckets.items():
            batch = torch.stack([self.replicate(updates[i]).view(shape) for i in members])
            ortho = newton_schulz(batch, dtype=self.ns_dtype)
            step = lr * (ortho * self._update_scale(group["scale"], shape))
            for i, one in zip(members, step.unbind(0), strict=True):
                deltas[i] = one.view_as(params[i]).to(params[i].dtype)
        decayed = torch._foreach_mul(params, 1 - lr * wd) if wd != 0 else params
        _assign(params, torch._foreach_sub(decayed, deltas))

    @staticmethod
    def _update_scale(convention: str, shape: tuple[int, ...]) -> float:
        """The factor an orthogonalised update (RMS about 1/sqrt(max(rows, cols))) is multiplied by before the LR.
        shape: tall matrices (the MLP's c_fc, 4C x C) take steps of the same RMS per element as square ones.
        max_dim: every matrix's steps have RMS about the LR itself."""
        rows, cols = shape[-2], shape[-1]
        return max(1.0, rows / cols) ** 0.5 if convention == "shape" else max(rows, cols) ** 0.5

    def _adamw_group(self, params: list[torch.Tensor], lr: torch.Tensor, wd: float) -> None:
        """AdamW with the per-tensor arithmetic (torch's single-tensor order), in foreach calls. Every parameter's
        step count is kept (the checkpoint layout), all equal, so the bias corrections come from the first."""
        states = [self.state[p] for p in params]
        grads = [p.grad.float() for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        beta1, beta2 = ADAM_BETAS
        steps = [s["step"] for s in states]
        _assign(steps, torch._foreach_add(steps, 1))
        _assign(exp_avgs, torch._foreach_lerp(exp_avgs, grads, 1 - beta1))
        _assign(exp_avg_sqs, torch._foreach_addcmul(torch._foreach_mul(exp_avg_sqs, beta2), grads, grads,
                                                    value=1 - beta2))
        step = states[0]["step"]
        bias1, bias2 = 1 - beta1**step, 1 - beta2**step
        denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_div(exp_avg_sqs, bias2)), ADAM_EPS)
        decayed = torch._foreach_mul(params, 1 - lr * wd) if wd != 0 else params
        moves = torch._foreach_div(torch._foreach_mul(exp_avgs, lr / bias1), denom)
        _assign(params, torch._foreach_sub(decayed, moves))


class ForeachAdamW(torch.optim.AdamW):
    """torch's AdamW with `capturable=True` (state and step counts on the device), the same arithmetic in the same
    order as its single-tensor path (torch/optim/adam.py `_single_tensor_adam`, torch 2.8/2.9), traced in a dozen
    foreach calls instead of ~17 ops per parameter. Why not torch's own foreach path: it refuses capturable on XLA
    (`_get_capturable_supported_devices`), and its single-tensor path re-derives the bias corrections from every
    parameter's own step count. Here the counts, all equal, are still kept and stepped per parameter (the checkpoint
    layout is unchanged), but the corrections are computed once per group, from the first."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._group_step(group, params)
        return None

    def _group_step(self, group: dict, params: list[torch.Tensor]) -> None:
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        _assign(steps, torch._foreach_add(steps, 1))
        decayed = torch._foreach_mul(params, 1 - lr * wd) if wd != 0 else params
        _assign(exp_avgs, torch._foreach_lerp(exp_avgs, grads, 1 - beta1))
        _assign(exp_avg_sqs, torch._foreach_addcmul(torch._foreach_mul(exp_avg_sqs, beta2), grads, grads,
                                                    value=1 - beta2))
        step = steps[0]
        step_size_neg = (lr / (1 - beta1**step)).neg()
        denom = torch._foreach_div(torch._foreach_sqrt(exp_avg_sqs), (1 - beta2**step).sqrt() * step_size_neg)
        # The list overload: with a single 0-dim tensor, _foreach_add reads it to the host (a graph and a transfer).
        denom = torch._foreach_add(denom, [eps / step_size_neg] * len(denom))
        _assign(params, torch._foreach_addcdiv(decayed, exp_avgs, denom))


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) with the same arithmetic as its per-tensor path (torch 2.8/2.9
    torch/nn/utils/clip_grad.py), in foreach calls: torch refuses foreach=True on XLA tensors, and its per-tensor
    fallback traces two ops per gradient from Python. Returns the total norm before clipping; max_norm 0 only
    measures it."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    if not max_norm:
        return total
    _assign(grads, torch._foreach_mul(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0)))
    return total


def muon_momentum_at(step: torch.Tensor, optim: OptimizerSettings) -> torch.Tensor:
    """Muon's momentum at `step` (a device tensor, so the warm-up never recompiles): a linear rise from
    muon_momentum_start to muon_momentum over muon_momentum_warmup_steps, then constant."""
    if not optim.muon_momentum_warmup_steps:
        return torch.full_like(step, optim.muon_momentum)
    progress = (step / optim.muon_momentum_warmup_steps).clamp(0.0, 1.0)
    return optim.muon_momentum_start + (optim.muon_momentum - optim.muon_momentum_start) * progress


def schedule_table(cfg: TrainConfig, steps: int) -> torch.Tensor:
    """What the optimizer is given at steps 0..steps-1, computed on the CPU as the step computes it: rows of
    (LR, the matrices' LR, Muon's momentum)."""
    at = torch.arange(steps, dtype=torch.float32)
    optim = cfg.optim
    lr = lr_at(at, optim, cfg.lr_schedule)
    matrix_lr = optim.muon_lr if optim.optimizer == "muon" else optim.matrix_lr or optim.lr
    return torch.stack([lr, lr * (matrix_lr / optim.lr), muon_momentum_at(at, optim)], dim=1)


def same_schedule_until(a: TrainConfig, b: TrainConfig, steps: int) -> bool:
    """Whether configs `a` and `b` give the optimizer exactly the same values at steps 0..steps-1: then a
    checkpoint at `steps` made under one is where the other would be too."""
    if a.optim.optimizer != b.optim.optimizer:
        return False
    return torch.equal(schedule_table(a, steps), schedule_table(b, steps))


def saved_schedule(cfg: TrainConfig, state: dict) -> tuple[TrainConfig, int]:
    """(the schedule a checkpoint was trained on, as `cfg` with its saved schedule fields, and its step), from its
    state.json's contents."""
    saved = saved_settings(state.get("config", {}).get("train", {}), "the checkpoint's config")
    # What decides a step's learning rates and Muon momentum: the optimizer's and the schedule's sections, whole
    # (a field the checkpoint predates keeps cfg's value).
    decides = [f.name for section in (OptimizerSettings, ScheduleSettings) for f in dataclasses.fields(section)]
    return cfg.replace(**{k: saved[k] for k in decides if k in saved}), int(state.get("step", 0))


def stable_phase_end(cfg: TrainConfig) -> int | None:
    """wsd: the step where the stable phase ends, the first whose update a longer run would make differently (its
    checkpoint holds every full-LR update and none decayed); None for cosine, or where the decay starts at once."""
    if cfg.lr_schedule.schedule != "wsd":
        return None
    steps = cfg.lr_schedule.total_steps
    never_decays = cfg.replace(total_steps=steps * 1000)
    differs = (schedule_table(cfg, steps) != schedule_table(never_decays, steps)).any(dim=1)
    end = int(differs.nonzero()[0, 0]) if differs.any() else None
    return end or None


def make_optimizer(named: NamedParams, optim: OptimizerSettings, runtime, lr: torch.Tensor,
                   saved: dict[str, torch.Tensor] | None = None,
                   momentum: torch.Tensor | None = None) -> torch.optim.Optimizer:
    """optim.optimizer with its state created up front: zeros, or `saved` tensors, laid out like their parameters
    (sharded under fsdp) instead of however the first step would make them. `momentum`: Muon's momentum as a
    device tensor the trainer moves each step (the warm-up), else the constant optim.muon_momentum."""
    device = runtime.device
    on_accelerator = device.type != "cpu"
    if optim.optimizer == "muon" or optim.matrix_lr:
        shapes = {name: muon_matrix_shape(name, p) for name, p in named}
        matrices = [(n, p) for n, p in named if shapes[n]]
        adam = [(n, p) for n, p in named if not shapes[n]]
        if optim.optimizer == "muon":
            matrix_group = {"kind": "muon", "lr_ratio": optim.muon_lr / optim.lr,
                            "weight_decay": optim.muon_weight_decay,
                            "momentum": optim.muon_momentum if momentum is None else momentum,
                            "scale": optim.muon_scale,
                            "shapes": {id(p): shapes[n] for n, p in matrices}}
        else:  # AdamW with its own LR for the matrices: the same groups and AdamW code as Muon's AdamW part
            matrix_group = {"kind": "adam", "lr_ratio": optim.matrix_lr / optim.lr,
                            "weight_decay": optim.weight_decay}
        aux = {"lr_ratio": optim.aux_lr / optim.lr} if optim.aux_lr else {}  # positions, biases, gains
        token_embedding = [p for n, p in adam if n.endswith("wte.weight")]
        groups = [
            {"params": [p for _, p in matrices], **matrix_group},
            {"params": token_embedding, "kind": "adam", "weight_decay": optim.weight_decay},
            {"params": [p for n, p in adam if p.dim() >= 2 and not n.endswith("wte.weight")], "kind": "adam",
             "weight_decay": optim.weight_decay, **aux},
            {"params": [p for _, p in adam if p.dim() < 2], "kind": "adam", "weight_decay": 0.0, **aux},
        ]
        opt = MuonAdamW(groups, lr, ns_dtype=torch.bfloat16 if on_accelerator else torch.float32,
                        replicate=runtime.replicate if runtime.shards_parameters else lambda t: t)
        keys = {id(p): MuonAdamW.state_keys(g) for g in groups for p in g["params"]}
        step_on_device = True
    else:
        # capturable on an accelerator (the step on the device); under XLA traced in foreach calls (ForeachAdamW);
        # CUDA runs torch's fused kernel, the CPU torch's single-tensor path.
        opt = (ForeachAdamW if device.type == "xla" else torch.optim.AdamW)(
            [{"params": [p for _, p in named if p.dim() >= 2], "weight_decay": optim.weight_decay},
             {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}],
            lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS, capturable=on_accelerator, foreach=False,
            fused=True if device.type == "cuda" else None,
        )
        keys = {id(p): ("exp_avg", "exp_avg_sq", "step") for _, p in named}
        step_on_device = on_accelerator  # capturable: step counts and bias corrections stay on the device
    for name, p in named:
        state = {}
        for key in keys[id(p)]:
            if key == "step":
                src = saved[f"{name}.step"] if saved else torch.zeros((), dtype=torch.float32)
                state[key] = runtime.place(src, src) if step_on_device else src
            else:
                src = saved[f"{name}.{key}"] if saved else torch.zeros(p.shape, dtype=torch.float32)
                state[key] = runtime.place(src, p)
        opt.state[p] = state
    return opt


def optimizer_tensors(opt: torch.optim.Optimizer, named: NamedParams) -> dict[str, torch.Tensor]:
    """The optimizer state on the host, keyed "<param name>.<state key>" (exp_avg, exp_avg_sq, step for AdamW;
    momentum_buffer for Muon's matrices)."""
    return {f"{name}.{key}": value.detach().to("cpu", torch.float32)
            for name, p in named for key, value in opt.state[p].items()}


def optimizer_of_state(tensors: dict[str, torch.Tensor]) -> str:
    """Which optimizer wrote a checkpoint's state (a Muon state has momentum buffers)."""
    return "muon" if any(k.endswith(".momentum_buffer") for k in tensors) else "adamw"
