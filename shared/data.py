"""Token shards in llm.c's format, and the training/validation loaders that read them.

A shard is a header of 256 int32 (magic 20240520, version 1, token count, then zeros) followed by the
tokens as uint16. Shards are read through a memory map, so a 100M-token shard costs no RAM up front.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.config import SHARD_HEADER_BYTES
from shared.errors import UserError
from shared.fsutil import atomic_write_bytes

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_BYTES = SHARD_HEADER_BYTES  # 256 int32; defined beside the configs, which size shards without numpy
HEADER_INTS = HEADER_BYTES // 4


def shard_header(num_tokens: int) -> np.ndarray:
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, num_tokens
    return header


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write `tokens` (all < 65536) as one shard; written to a temporary name, fsynced, then renamed."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("shard tokens must fit in uint16")
    atomic_write_bytes(path, shard_header(tokens.size).tobytes(), tokens.astype(np.uint16, copy=False).tobytes())


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard's tokens after checking its header and length; bad files are a UserError."""
    path = Path(path)
    try:
        size = path.stat().st_size
        header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    except OSError as err:
        raise UserError(f"{path}: cannot read shard ({err.strerror})") from None
    if header.size < HEADER_INTS:
        raise UserError(f"{path}: not a token shard (file shorter than its {HEADER_BYTES}-byte header)")
    if header[0] != SHARD_MAGIC:
        raise UserError(f"{path}: not a token shard (magic {header[0]}, expected {SHARD_MAGIC})")
    if header[1] != SHARD_VERSION:
        raise UserError(f"{path}: unsupported shard version {header[1]} (expected {SHARD_VERSION})")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + 2 * num_tokens
    if size != expected:
        raise UserError(
            f"{path}: truncated or padded shard: header says {num_tokens} tokens ({expected} bytes), file has {size}"
        )
    if num_tokens == 0:
        return np.zeros(0, dtype=np.uint16)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(num_tokens,))


def natural_key(text: str) -> list:
    """Sort key that orders the numbers inside names by value: shard_2 before shard_10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _shard_key(path: Path) -> tuple:
    # The file name first: the order (and so every epoch's permutation) must not change when the same shards
    # are mounted under other folder names, as Kaggle inputs are from one session to the next.
    return natural_key(path.name), natural_key(str(path))


def find_shards(data_dirs: str | os.PathLike | list, split: str) -> list[Path]:
    """All `*_{split}_*.bin` shards under the given directories (searched recursively), in natural order.

    `data_dirs` may be one directory, a comma-separated string of them, or a list (token parts 0..K).
    """
    if isinstance(data_dirs, (str, os.PathLike)):
        data_dirs = [d for d in str(data_dirs).split(",") if d]
    if not data_dirs:
        raise UserError("--data-dir: no data directory given")
    shards: list[Path] = []
    for d in map(Path, data_dirs):
        if not d.is_dir():
            raise UserError(f"--data-dir: {d} is not a directory")
        shards += [p for p in d.rglob(f"*_{split}_*.bin") if p.is_file()]
    return sorted(shards, key=_shard_key)


@dataclass
class LoaderState:
    """Where the training loader is: part of every checkpoint, so a resumed run reads the same next batch."""

    epoch: int = 0
    shard_index: int = 0  # index into this epoch's shard order
    offset: int = 0  # token offset inside that shard
    shards: list | None = None  # [file name, tokens] of every shard, in order: what the three numbers index

    def to_dict(self) -> dict:
        d = {"epoch": self.epoch, "shard_index": self.shard_index, "offset": self.offset}
        if self.shards is not None:
            d["shards"] = [list(s) for s in self.shards]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> LoaderState:
        shards = [[str(name), int(n)] for name, n in d["shards"]] if d.get("shards") is not None else None
        return cls(int(d["epoch"]), int(d["shard_index"]), int(d["offset"]), shards)


class TokenLoader:
    """Batches of `batch` rows of `seq_len + 1` consecutive tokens (inputs and targets share all but one).

    Training order: each epoch visits the shards in an order drawn from (seed, epoch) and reads every shard
    front to back; the state is three integers. With `shuffle=False` shards are read in order (validation).
    """

    def __init__(self, shards: list[Path], batch: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                 state: LoaderState | None = None, on_change: str = "error"):
        """`state`: where a resumed run stands. If it was saved over other shards (token parts added or
        removed), its position means nothing here: `on_change="error"` refuses in one line, `"new-epoch"`
        starts the next epoch over the shards given (no token of it repeated or skipped within that epoch)."""
        if not shards:
            raise UserError("no token shards found (expected files like fineweb_train_000001.bin)")
        self.shards = list(shards)
        self.batch, self.seq_len, self.seed, self.shuffle = batch, seq_len, seed, shuffle
        self.tokens_per_batch = batch * seq_len
        self._lengths = [read_shard(p).shape[0] for p in self.shards]  # validates every header up front
        if max(self._lengths) < self.tokens_per_batch + 1:
            raise UserError(
                f"{self.shards[0].parent}: no shard holds one batch ({self.tokens_per_batch + 1} tokens); "
                f"the largest has {max(self._lengths)}"
            )
        fingerprint = [[p.name, n] for p, n in zip(self.shards, self._lengths, strict=True)]
        self.state = state or LoaderState()
        if self.state.shards is not None and self.state.shards != fingerprint:
            saved, now = self.state.shards, fingerprint
            change = (f"{len(saved)} shards of {sum(n for _, n in saved):,} tokens then, {len(now)} of "
                      f"{sum(n for _, n in now):,} now")
            if on_change != "new-epoch":
                raise UserError(f"the checkpoint's data position is over other training shards ({change}); use "
                                "the same token parts, or --on-data-change new-epoch to go on with a new pass")
            self.state = LoaderState(self.state.epoch + 1, 0, 0)
            self.changed = change
        else:
            self.changed = ""
        self.state.shards = fingerprint
        self._cache: tuple[int, np.ndarray] | None = None

    def batches_per_pass(self) -> int:
        """Batches in one pass over the shards (a batch never spans two shards)."""
        return sum(max(0, n - 1) // self.tokens_per_batch for n in self._lengths)

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.shards)))
        return list(np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)))

    def _tokens(self, shard: int) -> np.ndarray:
        if self._cache is None or self._cache[0] != shard:
            self._cache = (shard, read_shard(self.shards[shard]))
        return self._cache[1]

    def next_batch(self) -> np.ndarray:
        """An int32 array of shape (batch, seq_len + 1); advances the state."""
        need = self.tokens_per_batch + 1
        st = self.state
        while True:
            order = self._order(st.epoch)
            shard = order[st.shard_index]
            if st.offset + need <= self._lengths[shard]:
                break
            st.shard_index, st.offset = st.shard_index + 1, 0
            if st.shard_index == len(order):
                st.epoch, st.shard_index = st.epoch + 1, 0
        tokens = self._tokens(shard)
        rows = st.offset + np.arange(self.batch)[:, None] * self.seq_len + np.arange(self.seq_len + 1)[None, :]
        st.offset += self.tokens_per_batch
        return tokens[rows].astype(np.int32)
