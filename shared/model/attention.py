"""The one owner of attention: which kernels a session tries on a TPU generation at a sequence length, in order,
for the `attention` setting (TrainConfig.attention: auto, splash, flash, sdpa) (`candidates`), the loop that tries
them (`choose`: each made, probed, the first that passes kept, why the others did not said), and the choice a model
is built with (`AttentionChoice`). One decision, asked by the session (shared/runtime/attention_select.py, which gives
`choose` its mesh's kernels and its probe, shared/runtime/attention_probe.py), the step tracer
(`shared.runtime.step_trace`, which gives it no probe: it traces the first kernel made), `--plan`
(scripts/chain/plan.py, which compiles the first and then each fallback), scripts/tpu_compile.py and
scripts/bench_mfu.py. `candidates` is pure: the generation's name, the length and the setting in, kernel names out;
whether jax and torchax import, and whether a kernel passes its probe, is the session's to find out.

Stdlib only: --plan asks here without importing torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared.tpu import TPU_GENERATIONS

# The kernels, as the runtime, the logs and the compiler's reports name them: jax's splash attention, torch_xla's
# Pallas flash attention, torch's SDPA.
SPLASH, FLASH, SDPA = "pallas-splash", "pallas-flash", "sdpa"
KERNELS = (SPLASH, FLASH, SDPA)  # the order a session tries them in, SDPA last (it always runs)
# Each kernel's word in the `attention` setting; `auto` starts from the first of KERNELS.
SETTING_OF = {SPLASH: "splash", FLASH: "flash", SDPA: "sdpa"}
FIRST_KERNEL = {"auto": KERNELS[0], **{word: kernel for kernel, word in SETTING_OF.items()}}
# The layout each Pallas kernel reads q, k and v in, which the attention makes them in (shared/model/model.py):
# splash reads them sequence-minor (shared/model/splash.py), torch_xla's flash kernel (B, H, T, D).
QKV_LAYOUTS = {SPLASH: "BHDT", FLASH: "BHTD"}
# Splash's query and key blocks (shared/model/splash.py): the causal mask's blocks above the diagonal are skipped whole.
SPLASH_BLOCK = 512
# torch_xla's flash wrapper takes each block as min(its default, T) (torch_xla 2.8.0 and 2.9.0,
# torch_xla/experimental/custom_kernel.py `FlashAttention.DEFAULT_BLOCK_SIZES`, and the min()s in
# `_fa_custom_forward_single_device` and `_fa_custom_backward_single_device`): key blocks of 512 (forward, dkv) and
# 256 (dq), query blocks of 512 (dkv) and 1024 (dq).
FLASH_KEY_BLOCKS = (512, 256)
FLASH_QUERY_BLOCKS = (512, 1024)
LANES = 128  # jax's flash kernel repeats its row statistics 128 lanes wide over a key block


def splash_fits(seq_len: int) -> bool:
    """Whether splash's blocks tile a sequence of `seq_len` (else the flash kernel is tried instead)."""
    block = min(SPLASH_BLOCK, seq_len)
    return seq_len % block == 0 and block % LANES == 0


def flash_fits(seq_len: int) -> bool:
    """Whether torch_xla's flash kernel runs at `seq_len`: every key block a multiple of 128 (jax 0.7.1 and 0.7.2,
    jax/experimental/pallas/ops/tpu/flash_attention.py: the backward kernels repeat each row's statistics
    `block_k // MIN_BLOCK_SIZE` times (lines 895 and 1228), a (T, 0) operand at gpt2-demo's 32 tokens, and the
    forward raises where more than one key block does, line 445), and every block dividing the sequence (its
    `_verify_block` in the backward kernels, lines 963-966 and 1308-1310)."""
    keys = [min(block, seq_len) for block in FLASH_KEY_BLOCKS]
    blocks = keys + [min(block, seq_len) for block in FLASH_QUERY_BLOCKS]
    return seq_len > 0 and all(b % LANES == 0 for b in keys) and all(seq_len % b == 0 for b in blocks)


TILES = {SPLASH: splash_fits, FLASH: flash_fits, SDPA: lambda seq_len: True}


def candidates(generation: str | None, seq_len: int, setting: str = "auto") -> tuple[str, ...]:
    """The kernels a session on TPU `generation` ("v5e"; None: no TPU) tries at `seq_len` tokens, in order, SDPA
    last: from the one `setting` names on (auto: splash), the Pallas kernels where the generation compiles them
    (not v2/v3) and their blocks tile the sequence. A chain whose session found a kernel hung or failed starts the
    next from the setting after it (scripts/chain/attention_carry.py `carried_attention`)."""
    return tuple(name for name in _from_setting(generation, setting) if TILES[name](seq_len))


def untiled_kernels(generation: str | None, seq_len: int, setting: str = "auto") -> list[str]:
    """The Pallas kernels ("splash", "flash") a session on `generation` would try for `setting` but for their
    blocks, which do not tile `seq_len`: why it runs SDPA at gpt2-demo's 32 tokens."""
    return [SETTING_OF[name] for name in _from_setting(generation, setting) if not TILES[name](seq_len)]


def _from_setting(generation: str | None, setting: str) -> tuple[str, ...]:
    gen = TPU_GENERATIONS.get(generation or "")
    pallas = bool(gen and gen.pallas_flash_attention)
    start = KERNELS.index(FIRST_KERNEL[setting])
    return tuple(name for name in KERNELS[start:] if pallas or name == SDPA)


@dataclass(frozen=True)
class AttentionChoice:
    """The attention a model runs, given to it when built (shared/model/model.py `GPT(cfg, attention)`): `kind`
    (one of KERNELS), the causal `kernel` (q, k, v) -> out of shape (B, H, T, D) (None: SDPA), the `seq_len` it
    runs at (the length its probe passed at; other lengths, such as the in-training HellaSwag eval's rows, take
    SDPA, as a Pallas kernel's blocks may not tile them; None: any), and `qkv_layout`, the memory layout the
    kernel reads q, k and v in ("BHTD", or "BHDT": the sequence minor; None: the projection's own), which the
    attention then makes them in straight from the projection."""

    kind: str = SDPA
    kernel: Callable | None = None
    seq_len: int | None = None
    qkv_layout: str | None = None

    def kernel_for(self, seq_len: int) -> Callable | None:
        """The kernel where it runs at `seq_len`, else None (SDPA)."""
        return self.kernel if self.kernel is not None and self.seq_len in (None, seq_len) else None


SDPA_CHOICE = AttentionChoice()


def kernel_choice(kind: str, kernel: Callable, seq_len: int) -> AttentionChoice:
    """Pallas kernel `kind` (its probe passed at `seq_len`), with the q, k, v layout it reads."""
    return AttentionChoice(kind, kernel, seq_len, QKV_LAYOUTS[kind])


# How the line a session stops on where a kernel's probe hung begins (shared/runtime/attention_probe.py `hung_line`);
# the chain reads it back to start the next session past that kernel (scripts/chain/attention_carry.py).
HUNG_PROBE_LINE = "stopping before training: the {word}-attention kernel's probe gave "
_HUNG_PROBE = re.compile(re.escape(HUNG_PROBE_LINE).replace(re.escape("{word}"), r"(\w+)"))


def hung_kernel(line: str) -> str | None:
    """The setting's word ("splash") of the kernel whose probe hung, where `line` is a session's line saying so."""
    found = _HUNG_PROBE.search(line)
    return found.group(1) if found and found.group(1) in FIRST_KERNEL else None


def fallback_text(then: str) -> str:
    """What a session does where a kernel fails, `then` the next candidate: the end of the line that says so."""
    return "trying the flash-attention kernel" if then == FLASH else "using SDPA"


def _say(line: str) -> None:
    print(line, flush=True)


def choose(kinds: Sequence[str], shape: tuple[int, int, int, int], make: Callable[[str, str], Callable | None],
           probe: Callable[[str, Callable, str, tuple[int, int, int, int]], str | bool | None] | None = None,
           start: Callable[[list[str]], None] = lambda settings: None, devices: int = 1,
           log: Callable[[str], None] = _say, batch_for: Callable[[str], int] | None = None) -> AttentionChoice:
    """The attention a session runs at `shape` (B, H, T, D; B over all `devices`): the first of `kinds`
    (`candidates`, SDPA last) whose kernel is made and passes its probe; else SDPA. `batch_for(kind)`: the B each
    kernel would train at (`--micro-batch auto`: each kernel's own), which its probe runs at; None: `shape`'s.

    `make(kind, instead)`: the kernel, or None where it does not import (it says so, ending with `instead`, what the
    session does then). The flash kernel's (its jax) is made first: where it is not, no other is tried. `start(words)`:
    told the settings' words ("splash", "flash") of the kernels made, in order, before the first probe.
    `probe(word, kernel, instead, shape)`: None where the kernel runs and agrees with SDPA at `shape`; else why not
    (a line, said here with the shapes and `instead`), or False where it was not probed (it said why: the probes'
    budget spent). Its errors (ProbeHung: a probe that hung) stop the selection. Each kernel is probed once. No
    `probe` (the step tracer, which cannot run a kernel): the first kernel made is kept."""
    if len(kinds) < 2:  # SDPA alone
        return SDPA_CHOICE
    flash = make(FLASH, fallback_text(SDPA))  # jax, which every Pallas kernel needs: bounded, and first
    if flash is None:
        return SDPA_CHOICE
    made = []  # (kind, kernel or None where it does not import, what a failure leads to)
    for kind, then in zip(kinds, kinds[1:], strict=False):
        instead = fallback_text(then)
        made.append((kind, flash if kind == FLASH else make(kind, instead), instead))
    start([SETTING_OF[kind] for kind, kernel, _ in made if kernel is not None])
    _, n_head, seq_len, head_dim = shape
    for kind, kernel, instead in made:
        if kernel is None:
            continue
        batch = batch_for(kind) if batch_for else shape[0]
        failure = None if probe is None else probe(SETTING_OF[kind], kernel, instead, (batch, *shape[1:]))
        if failure is False:  # not probed: said
            continue
        if not failure:
            return kernel_choice(kind, kernel, seq_len)
        log(f"notice: the Pallas {SETTING_OF[kind]}-attention kernel failed its probe at this session's shapes "
            f"({batch // devices} sequences x {n_head} heads x {seq_len} tokens x {head_dim} per device): "
            f"{failure}; {instead}")
    return SDPA_CHOICE
