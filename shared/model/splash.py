"""jax's splash attention (a Pallas kernel) in the train step on TPU, called through torch_xla's `call_jax`.

Why before torch_xla's flash kernel: that kernel keeps its per-row residuals (l, m, and the row sums in the
backward) 128 f32 lanes wide, and on v6e-8 their reads and writes are two thirds of its time. Splash reads its one
residual compact in the backward and skips the causal mask's empty blocks (docs/tpu-throughput.md, "Splash
attention").

Each device runs the kernel on its own sequences (manual sharding over the batch, as torch_xla's flash wrapper
does), vmapped over them. It reads q, k and v with the sequence minor (jax's SEQ_MINOR layout), the layout the
attention's projections are made in when this kernel is installed (model.py, `qkv_layout` "BHDT"): XLA then places no
copies between the matmuls and the kernel. The forward keeps its logsumexp, and the backward hands it and the
output to jax's own backward rule for the kernel: two kernel calls a layer, not three. That rule is private, so
where this jax lays it out otherwise (`backward_rule_usable`) the backward runs the forward again inside `jax.vjp`
instead, as torch_xla's own splash wrapper (torch_xla/experimental/splash_attention.py) does. `call_jax` needs
torchax beside jax; a session installs it where the image's is missing or broken (shared/kaggle/packages.py).
`interpret=True` runs the kernel in Pallas's interpreter on any jax backend: how its numerics are tested on a CPU.

torch and the standard library at module level; jax and torch_xla where used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

# Query and key blocks; where they tile a sequence is `splash_fits`, beside flash's rule (shared/model/attention.py).
from shared.model.attention import SPLASH_BLOCK as BLOCK


def _kernel(n_head: int, seq_len: int, interpret: bool, save_residuals: bool = False):
    # Built inside the traced function: its mask tables are then constants of the lowered module. Built outside,
    # jax.vjp would pass them in as arguments, which call_jax's computation does not take.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    block = min(BLOCK, seq_len)
    seq_minor = kernel.QKVLayout.SEQ_MINOR  # (D, T) blocks: what the projections make (model.py), no copies
    sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True,
                              q_layout=seq_minor, k_layout=seq_minor, v_layout=seq_minor)
    causal = masks.MultiHeadMask(masks=(masks.CausalMask(shape=(seq_len, seq_len)),) * n_head)
    return kernel.make_splash_mha(mask=causal, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                  save_residuals=save_residuals, interpret=interpret)


def _forward(q, k, v, interpret: bool = False):
    """jax: causal attention of one device's (B, H, T, D) q, k, v, scaled by 1/sqrt(D) as SDPA scales it."""
    import jax

    return jax.vmap(_kernel(q.shape[1], q.shape[2], interpret))(_scaled(q), k, v)


def _scaled(q):
    return (q * (q.shape[-1] ** -0.5)).astype(q.dtype)  # the kernel takes its scale in q (MaxText does the same)


def _backward(q, k, v, grad, interpret: bool = False):
    """jax: the gradients of q, k and v, the forward run again for its residual."""
    import jax

    _, vjp = jax.vjp(functools.partial(_forward, interpret=interpret), q, k, v)
    return vjp(grad)


def _forward_saving(q, k, v, interpret: bool = False):
    """jax: (out, logsumexp (B, H, T) in f32), the residual jax's backward rule reads with out."""
    import jax

    out, (logsumexp,) = jax.vmap(_kernel(q.shape[1], q.shape[2], interpret, save_residuals=True))(_scaled(q), k, v)
    return out, logsumexp


def _backward_from_residuals(q, k, v, out, logsumexp, grad, interpret: bool = False):
    """jax: the gradients of q, k and v by jax's own backward rule for the kernel, given the forward's out and
    logsumexp: the forward is not run again."""
    import jax
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel

    splash = _kernel(q.shape[1], q.shape[2], interpret)
    options = splash.kwargs
    dq_info, dkv_info = (_collapsed(info) for info in (splash.dq_mask_info, splash.dkv_mask_info))

    def one_sequence(q1, k1, v1, out1, logsumexp1, grad1):
        residuals = (q1, k1, v1, None, None, out1, logsumexp1, dq_info, dkv_info)
        grads = kernel._splash_attention_bwd(False, options["mask_value"], False, options["block_sizes"], None,
                                             options["mask_function"], options["attn_logits_soft_cap"], interpret,
                                             residuals, grad1)
        return grads[3:6]

    dq, dk, dv = jax.vmap(one_sequence)(_scaled(q), k, v, out, logsumexp, grad)
    return _scaled(dq), dk, dv  # d(q * s)/dq = s


def _collapsed(info):
    # As jax's own entry (_splash_attention) hands mask infos to the kernels: partial mask blocks as one stack.
    if info is None or info.partial_mask_blocks is None:
        return info
    return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(-1, *info.partial_mask_blocks.shape[-2:]))


# jax's backward rule for the kernel is private: its arguments and residuals as jax 0.7.x lays them out. Where this
# jax's differ, the backward runs the forward again through jax.vjp (public) instead.
_BACKWARD_RULE_PARAMETERS = ("save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name",
                             "mask_function", "attn_logits_soft_cap", "interpret", "res", "do")
_FORWARD_RULE_PARAMETERS = ("fwd_mask_info", "dq_mask_info", "dkv_mask_info", "q", "k", "v", "segment_ids", "sinks")


def backward_rule_usable() -> bool:
    """Whether this jax's private splash rules take what `_backward_from_residuals` passes (jax 0.7.x's)."""
    import inspect

    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel

    try:
        backward = tuple(inspect.signature(kernel._splash_attention_bwd).parameters)
        forward = tuple(inspect.signature(kernel._splash_attention_fwd).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return backward == _BACKWARD_RULE_PARAMETERS and forward[:8] == _FORWARD_RULE_PARAMETERS


# call_jax caches a lowered function by its identity: one object each, for the kernel and for its interpreter.
_FUNCTIONS = {False: (_forward, _backward),
              True: (functools.partial(_forward, interpret=True), functools.partial(_backward, interpret=True))}
_SAVING_FUNCTIONS = {
    False: (_forward_saving, _backward_from_residuals),
    True: (functools.partial(_forward_saving, interpret=True),
           functools.partial(_backward_from_residuals, interpret=True))}


def splash_attention(mesh, interpret: bool = False, reuse_forward: bool | None = None
                     ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """(q, k, v) -> causal attention, each (B, H, T, D) with the batch sharded over `mesh`'s "data" axis. The
    backward reads the forward's out and logsumexp where `reuse_forward` (default: where jax's rule allows it),
    else it runs the forward again."""
    import torch_xla.core.xla_builder as xb
    import torch_xla.distributed.spmd as xs

    if reuse_forward is None:
        reuse_forward = backward_rule_usable()

    def local(t: torch.Tensor) -> torch.Tensor:
        spec = ("data",) + (None,) * (t.dim() - 1)
        return xs.enable_manual_sharding(t.contiguous(), spec, mesh=mesh).global_tensor

    def whole(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        spec = ("data",) + (None,) * (t.dim() - 1)
        return xs.disable_manual_sharding(t, spec, shape, mesh=mesh).global_tensor

    forward, backward = _FUNCTIONS[interpret]
    saving, from_residuals = _SAVING_FUNCTIONS[interpret]

    class SplashAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            # Without gradients (an eval), the plain forward: no logsumexp written for a backward that never runs.
            ctx.reused = reuse_forward and any(ctx.needs_input_grad)
            if not ctx.reused:
                ctx.save_for_backward(q, k, v)
                return whole(xb.call_jax(forward, (local(q), local(k), local(v))), q.shape)
            out, logsumexp = xb.call_jax(saving, (local(q), local(k), local(v)))
            out, logsumexp = whole(out, q.shape), whole(logsumexp, q.shape[:-1])
            ctx.save_for_backward(q, k, v, out, logsumexp)
            return out

        @staticmethod
        def backward(ctx, grad):
            saved = [local(t) for t in ctx.saved_tensors]
            grads = xb.call_jax(from_residuals if ctx.reused else backward, (*saved, local(grad)))
            return tuple(whole(g, ctx.saved_tensors[0].shape) for g in grads)

    return SplashAttention.apply
