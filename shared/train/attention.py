"""Which attention kernels a session on a TPU generation tries at a sequence length, in order: one decision, taken
here by the session (`XlaRuntime.select_attention`, which probes each and keeps the first that passes), the step
tracer (`shared.train.step_trace`, which traces the first: it cannot probe) and `--plan` (scripts/chain/plan.py,
which compiles the first and then each fallback). Pure: the generation's name, the length and the environment's
switches in, kernel names out; whether jax and torchax import is the session's to find out.

Stdlib only: --plan asks here without importing torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from shared.tpu import TPU_GENERATIONS

# Every kernel in the order a session tries them: jax's splash attention, torch_xla's Pallas flash attention, SDPA.
KERNELS = ("pallas-splash", "pallas-flash", "sdpa")
# Splash's query and key blocks (shared/train/splash.py): the causal mask's blocks above the diagonal are skipped whole.
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


def attention_candidates(generation: str | None, seq_len: int, first: str = "",
                         env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The kernels a session on TPU `generation` ("v5e"; None: no TPU) tries at `seq_len` tokens, in order, SDPA
    last: the Pallas kernels where the generation compiles them (not v2/v3) and GPT2K_FLASH_ATTENTION is not 0;
    splash where GPT2K_SPLASH_ATTENTION is not 0 and its blocks tile the sequence, flash where its blocks do.
    `first`: none before that kernel (a second selection starts from the kernel the first kept). `env`: the
    switches (default: this process's environment)."""
    allowed = _switched_on(generation, env)
    start = KERNELS.index(first) if first else 0
    return tuple(name for name in KERNELS[start:] if allowed[name] and TILES[name](seq_len))


def untiled_kernels(generation: str | None, seq_len: int, env: Mapping[str, str] | None = None) -> list[str]:
    """The Pallas kernels ("splash", "flash") a session on `generation` would try but for their blocks, which do
    not tile `seq_len`: why it runs SDPA at gpt2-demo's 32 tokens."""
    allowed = _switched_on(generation, env)
    return [name.removeprefix("pallas-") for name in KERNELS[:-1] if allowed[name] and not TILES[name](seq_len)]


def _switched_on(generation: str | None, env: Mapping[str, str] | None) -> dict[str, bool]:
    env = os.environ if env is None else env
    gen = TPU_GENERATIONS.get(generation or "")
    pallas = bool(gen and gen.pallas_flash_attention) and env.get("GPT2K_FLASH_ATTENTION", "1") != "0"
    return {"pallas-splash": pallas and env.get("GPT2K_SPLASH_ATTENTION", "1") != "0", "pallas-flash": pallas,
            "sdpa": True}


TILES = {"pallas-splash": splash_fits, "pallas-flash": flash_fits, "sdpa": lambda seq_len: True}
