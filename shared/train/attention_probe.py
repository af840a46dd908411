"""Is a candidate attention kernel (flash attention on a TPU) right here, on this device and these shapes? Its
output and gradients against SDPA's, once, before a session trusts it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared.errors import UserError, within
from shared.train.mosaic_version import refusal_line

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
# The probe compiles and runs two small graphs (the kernel's and SDPA's, forward and backward): seconds to a couple
# of minutes on a TPU. Ten minutes without an answer is a hang, and the session goes on with SDPA.
PROBE_TIMEOUT_S = 600.0


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
                           tolerance: float = ATTENTION_PROBE_TOLERANCE,
                           timeout_s: float | None = None) -> str | None:
    """Run `kernel` (q, k, v) -> causal attention forward and backward on random bf16 q, k, v of `shape` (B, H, T, D)
    on `device`, each laid out by `place` (the runtime's batch sharding), against SDPA in fp32 on the same inputs.
    None if the output and the gradients of q, k and v all agree within `tolerance`; else one line naming what
    differs, why the kernel failed, or that it gave no answer within `timeout_s` (default PROBE_TIMEOUT_S: a
    compile or run that hangs would otherwise hold the session until its kill; it is left in a daemon thread)."""
    timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        return within(timeout_s, lambda: _probe(kernel, shape, torch.device(device), place, sync, tolerance))
    except UserError as err:
        return f"the probe gave {err}"


def _probe(kernel: Callable, shape: tuple[int, int, int, int], device: torch.device,
           place: Callable[[torch.Tensor], torch.Tensor], sync: Callable[[], None], tolerance: float) -> str | None:
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
        # libtpu's refusal of the kernel's Mosaic version may sit deep in a long error: the caller acts on it.
        return f"{type(err).__name__}: {refusal_line(str(err)) or (lines[0][:200] if lines else '')}"
    # `not error <= tolerance` also fails NaN and inf (a kernel whose gradients overflow).
    bad = [f"{name} by {error:.3g}" for name, error in zip(PROBE_RESULTS, errors, strict=True)
           if not error <= tolerance]
    if bad:
        return (f"it differs from SDPA: {', '.join(bad)} (max error over SDPA's largest value; "
                f"tolerance {tolerance:g})")
    return None
