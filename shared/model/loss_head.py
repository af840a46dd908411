"""The loss head: the tied output projection and its cross-entropy, a chunk of positions at a time, with no
[tokens x vocab] tensor kept for the backward pass.

Unchunked, the head writes bf16 logits, then fp32 logits and an fp32 log-softmax over 50,304 columns that autograd
keeps until the backward: up to 10 bytes a logit (4.1 GB a chip for 8 sequences of 1,024 tokens), written and read
again. Here each chunk of positions makes its bf16 logits, their fp32 logsumexp, and
at once its gradients: the loss is the step's last op and its gradient a scalar, so d(loss)/d(logits) is known in
the forward pass. The chunk's logits then die; only the hidden states' and the projection's fp32 gradients
(tokens x 768 and 50,304 x 768) wait for the backward pass, which scales them by the incoming gradient. No matmul
is run twice: the FLOPs are the unchunked head's.

Chunks cut the positions (dim 1), never the batch: under SPMD the batch is what is sharded, so every chip works
on every chunk.
"""

from __future__ import annotations

import torch

CHUNK_POSITIONS = 256  # positions a chunk: 16 sequences a chip x 256 x 50,304 fp32 = 0.8 GB of logits at a time


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast would run the head's matmul in here (bf16 under bf16 autocast), else x's own."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def head_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
              padding: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of `targets` (B, T) under logits hidden (B, T, C) @ weight (V, C).T, the columns
    where `padding` (V,) is True left out of the softmax. The matmuls run in the autocast dtype, the softmax in
    fp32."""
    dtype = compute_dtype(hidden)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    targets = targets.long()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(hidden, weight, targets, padding)
    with torch.autocast(hidden.device.type, enabled=False):
        return sum(_chunk_terms(hidden, weight, targets, padding, start)[0].sum()
                   for start in range(0, hidden.shape[1], CHUNK_POSITIONS)) / targets.numel()


def _chunk_terms(hidden, weight, targets, padding, start):
    """One chunk's per-position loss (B, t) and its fp32 logits (B, t, V), padded columns at -inf."""
    stop = start + CHUNK_POSITIONS
    logits = (hidden[:, start:stop] @ weight.t()).float().masked_fill(padding, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    # The target's logit by a comparison with the column index, not a gather: an elementwise op and a reduction,
    # which XLA fuses with the logsumexp (gathers and scatters are slow on TPU).
    is_target = torch.arange(logits.shape[-1], device=logits.device) == targets[:, start:stop, None]
    target_logit = torch.where(is_target, logits, 0.0).sum(dim=-1)
    return lse - target_logit, logits, lse, is_target


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, padding):
        tokens = targets.numel()
        # The mean's 1/tokens goes into each chunk before its sums, not onto the sums after: under SPMD those sums
        # are partial over the sharded batch and all-reduced, and a multiply after an all-reduce keeps XLA from
        # moving it out of the accumulation loop. In fp16 the scaled gradients would underflow: scaled at the end.
        scale_early = hidden.dtype != torch.float16
        inv_tokens = 1.0 / tokens
        loss_sum = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden, grad_weight = [], None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[1], CHUNK_POSITIONS):
                losses, logits, lse, is_target = _chunk_terms(hidden, weight, targets, padding, start)
                loss_sum = loss_sum + (losses * inv_tokens).sum()
                # d(sum of losses)/d(logits) = softmax - one-hot, made in fp32, then cast to the matmul's dtype.
                grad_logits = torch.exp(logits - lse[..., None]) - is_target.float()
                grad_logits = (grad_logits * inv_tokens if scale_early else grad_logits).to(hidden.dtype)
                grad_hidden.append((grad_logits @ weight).float())
                # Summed in the matmul's dtype: under SPMD each chunk's product is a partial sum over the sharded
                # batch, and XLA reduces a plain sum of them across chips once (a cast between would make it
                # reduce every chunk's).
                chunk_grad = torch.einsum("btv,btc->vc", grad_logits, hidden[:, start:start + CHUNK_POSITIONS])
                grad_weight = chunk_grad if grad_weight is None else grad_weight + chunk_grad
        ctx.save_for_backward(torch.cat(grad_hidden, dim=1), grad_weight.float())
        ctx.late_scale, ctx.dtypes = (1.0 if scale_early else inv_tokens), (hidden.dtype, weight.dtype)
        return loss_sum

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.float() if ctx.late_scale == 1.0 else grad_loss.float() * ctx.late_scale
        return (grad_hidden * scale).to(ctx.dtypes[0]), (grad_weight * scale).to(ctx.dtypes[1]), None, None
