"""Is a candidate attention kernel (flash attention on a TPU) right here, on this device and these shapes? Its
output and gradients against SDPA's, and its forward without gradients (an eval's), once, before a session trusts
it; all of a session's probes within one budget (`ProbeBudget`), and a probe that outlasts it stops the session
(`ProbeHung`: docs/tpu-throughput.md, "The kernel probes' budget"). The loop that probes the candidates in order,
keeping the first that passes as the session's `AttentionChoice`, is shared/model/attention.py `choose`;
shared/runtime/attention_select.py gives it the kernels (which need the mesh) and their probe within this budget."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

from shared.errors import UserError, duration_text, within
from shared.model.attention import HUNG_PROBE_LINE
from shared.runtime.mosaic_version import before_lowering, refusal_line

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
# "no-grad output": the kernel's forward without gradients, which splash (shared/model/splash.py) and torch_xla's
# flash kernel (custom_kernel.py `save_residuals`, 2.8.0 L327-328) run as a kernel of its own, against SDPA's output.
PROBE_RESULTS = ("output", "dq", "dk", "dv", "no-grad output")
# Importing a kernel's jax (shared/runtime/xla_runtime.py): ten minutes without an answer is a hang.
PROBE_TIMEOUT_S = 600.0
# A probe compiles and runs three small graphs' worth (the kernel's and SDPA's, forward and backward, and the
# kernel's forward alone): seconds to a couple of minutes on a TPU. All of a session's probes (up to two kernels,
# each once at the micro-batch it would train at, and again at a pinned Mosaic version) share this; a probe is
# started only with PROBE_FLOOR_S left, as one given less would stop a session whose kernel is merely slow to compile.
PROBE_BUDGET_S = 900.0
PROBE_FLOOR_S = 60.0
# The attention setting (TrainConfig.attention; a chain's train.attention) that skips each kernel, for a session
# that stopped on its probe.
KERNEL_SWITCHES = {"splash": "--attention flash", "flash": "--attention sdpa"}


class ProbeHung(UserError):
    """A kernel's probe gave no answer within what was left of the session's budget: its thread is still inside
    the kernel's compile or run, which the session's next graph (and torch_xla's exit) would wait for."""


class ProbeBudget:
    """The time all of a session's kernel probes may take together, counted from its making."""

    def __init__(self, seconds: float | None = None, floor_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.seconds = PROBE_BUDGET_S if seconds is None else seconds
        self.floor_s = PROBE_FLOOR_S if floor_s is None else floor_s
        self._clock = clock
        self._start = clock()

    def left(self) -> float:
        return max(0.0, self.seconds - (self._clock() - self._start))

    def allows_a_probe(self) -> bool:
        left = self.left()
        return left > 0 and left >= self.floor_s

    def start_line(self, kernels: list[str]) -> str:
        """The line a selection's probing starts with: the kernels in order, and the time they have."""
        return f"probing attention kernels: {', then '.join(kernels)}, at most {duration_text(self.seconds)} in all"

    def spent_line(self, name: str, instead: str) -> str:
        return (f"notice: the attention probes' {duration_text(self.seconds)} are spent: the {name}-attention "
                f"kernel is not probed; {instead}")


def hung_line(name: str, err: UserError) -> str:
    """Why a session stops on a probe that hung, in one line."""
    return (f"{HUNG_PROBE_LINE.format(word=name)}{err} (what was left of the "
            "session's budget for its kernel probes); its compile or run may still hold the TPU, which the first "
            f"training step and torch_xla's exit would wait for ({KERNEL_SWITCHES.get(name, 'SDPA')} skips it)")


def end_at_exit_without_device_wait(code: int = 2) -> None:
    """At this process's exit, end it (with `code`, a UserError's: shared/errors.py `run_cli`) before
    torch_xla's exit hook waits for the device, which a hung probe's graph may hold for ever (torch_xla 2.8.0:
    __init__.py L214-232 registers `_prepare_to_exit` at import, which waits for every device op:
    init_python_bindings.cpp L235-243). Exit hooks run last registered first: this one, registered after
    torch_xla's import, runs before it."""
    import atexit

    def exit_now() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed stream: nothing more to say
                pass
        os._exit(code)

    atexit.register(exit_now)


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
    on `device`, each laid out by `place` (the runtime's batch sharding), and forward alone under no_grad, against
    SDPA in fp32 on the same inputs. None if the outputs and the gradients of q, k and v all agree within
    `tolerance`; else one line naming what differs or why the kernel failed. ProbeHung where it gave no answer
    within `timeout_s` (default PROBE_BUDGET_S): it is left in a daemon thread, still in the kernel's compile or
    run."""

    timeout_s = PROBE_BUDGET_S if timeout_s is None else timeout_s

    def probe() -> str | None:
        before_lowering()  # jax is imported by now, where the kernel needs it: the Mosaic version is set here
        return _probe(kernel, shape, torch.device(device), place, sync, tolerance)

    try:
        return within(timeout_s, probe)
    except UserError as err:  # only the time limit: _probe turns the kernel's own errors into a line
        raise ProbeHung(str(err)) from None


def _probe(kernel: Callable, shape: tuple[int, int, int, int], device: torch.device,
           place: Callable[[torch.Tensor], torch.Tensor], sync: Callable[[], None], tolerance: float) -> str | None:
    # What else is pending on the device is run first, in a graph of its own: a compile that fails inside `sync()`
    # leaves every tensor then pending without data, and each later sync fails on it while it lives ("Check failed:
    # tensor_data", torch_xla 2.8.0 and 2.9.0 on the CPU backend). The kernel's failure so breaks only its own.
    sync()
    try:
        gen = torch.Generator().manual_seed(0)
        inputs = [torch.randn(shape, generator=gen) for _ in range(4)]  # q, k, v and the output's gradient
        inputs = [t.to(torch.bfloat16) for t in inputs]  # both runs see exactly the same (bf16) values
        got = _attention_and_grads(kernel, inputs, torch.bfloat16, device, place)
        want = _attention_and_grads(sdpa_causal, inputs, torch.float32, device, place)
        with torch.no_grad():  # as an eval runs it: a kernel of its own (no residuals kept)
            plain = kernel(*(place(t.to(device, torch.bfloat16)) for t in inputs[:3]))
        got, want = (*got, plain), (*want, want[0])
        errors = torch.stack([(g.float() - w).abs().max() / w.abs().max() for g, w in zip(got, want, strict=True)])
        del got, want, plain  # under XLA the graph then returns only the errors, not the full-size tensors
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
