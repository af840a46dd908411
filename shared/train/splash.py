"""jax's splash attention (a Pallas kernel) in the train step on TPU, called through torch_xla's `call_jax`.

Why before torch_xla's flash kernel: that kernel keeps its per-row residuals (l, m, and the row sums in the
backward) 128 f32 lanes wide, and on v6e-8 their reads and writes are two thirds of its time. Splash reads its one
residual compact in the backward and skips the causal mask's empty blocks. Compiled for v6e-8 by libtpu, gpt2's
step's ceiling goes from 31.8% to 36.8% with 4.5 GiB less HBM a chip (docs/tpu-throughput.md, "Splash attention").

Each device runs the kernel on its own sequences (manual sharding over the batch, as torch_xla's flash wrapper
does), vmapped over them. The backward runs the forward again inside `jax.vjp`, as torch_xla's own splash wrapper
(torch_xla/experimental/splash_attention.py) does: nothing but q, k and v is kept between the two. `call_jax`
needs torchax beside jax; a session installs it where the image's is missing or broken (shared/kaggle/packages.py).
`interpret=True` runs the kernel in Pallas's interpreter on any jax backend: how its numerics are tested on a CPU.

torch and the standard library at module level; jax and torch_xla where used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

BLOCK = 512  # query and key blocks: the causal mask's blocks above the diagonal are skipped whole


def splash_fits(seq_len: int) -> bool:
    """Whether the kernel's blocks tile a sequence of `seq_len` (else the flash kernel is tried instead)."""
    block = min(BLOCK, seq_len)
    return seq_len % block == 0 and block % 128 == 0


def _kernel(n_head: int, seq_len: int, interpret: bool):
    # Built inside the traced function: its mask tables are then constants of the lowered module. Built outside,
    # jax.vjp would pass them in as arguments, which call_jax's computation does not take.
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    block = min(BLOCK, seq_len)
    sizes = kernel.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    causal = masks.MultiHeadMask(masks=(masks.CausalMask(shape=(seq_len, seq_len)),) * n_head)
    return kernel.make_splash_mha(mask=causal, head_shards=1, q_seq_shards=1, block_sizes=sizes,
                                  interpret=interpret)


def _forward(q, k, v, interpret: bool = False):
    """jax: causal attention of one device's (B, H, T, D) q, k, v, scaled by 1/sqrt(D) as SDPA scales it."""
    import jax

    scaled = (q * (q.shape[-1] ** -0.5)).astype(q.dtype)  # the kernel takes its scale in q (MaxText does the same)
    return jax.vmap(_kernel(q.shape[1], q.shape[2], interpret))(scaled, k, v)


def _backward(q, k, v, grad, interpret: bool = False):
    """jax: the gradients of q, k and v, the forward run again for its residual."""
    import jax

    _, vjp = jax.vjp(functools.partial(_forward, interpret=interpret), q, k, v)
    return vjp(grad)


# call_jax caches a lowered function by its identity: one object each, for the kernel and for its interpreter.
_FUNCTIONS = {False: (_forward, _backward),
              True: (functools.partial(_forward, interpret=True), functools.partial(_backward, interpret=True))}


def splash_attention(mesh, interpret: bool = False) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                                                torch.Tensor]:
    """(q, k, v) -> causal attention, each (B, H, T, D) with the batch sharded over `mesh`'s "data" axis."""
    import torch_xla.core.xla_builder as xb
    import torch_xla.distributed.spmd as xs

    spec = ("data", None, None, None)
    forward, backward = _FUNCTIONS[interpret]

    def local(t: torch.Tensor) -> torch.Tensor:
        return xs.enable_manual_sharding(t.contiguous(), spec, mesh=mesh).global_tensor

    def whole(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return xs.disable_manual_sharding(t, spec, shape, mesh=mesh).global_tensor

    class SplashAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return whole(xb.call_jax(forward, (local(q), local(k), local(v))), q.shape)

        @staticmethod
        def backward(ctx, grad):
            q, k, v = ctx.saved_tensors
            grads = xb.call_jax(backward, (local(q), local(k), local(v), local(grad)))
            return tuple(whole(g, q.shape) for g in grads)

    return SplashAttention.apply
