"""Tokenize a text corpus into llm.c shards, one restartable part at a time.

The corpus is a stream of documents: a Hugging Face dataset read with `datasets` streaming, or local
parquet/jsonl files read through the same streaming path. Every document becomes `<|endoftext|>` followed
by its GPT-2 tokens (tiktoken's `encode_ordinary`, on a pool of processes), and the token stream is cut
into shards of exactly `shard_size` tokens (`shared.data.write_shard`). The first shard of part 0 is the
validation shard.

A position in the stream is `(doc, offset)`: the next token is token `offset` of document `doc` (0-based,
counting the EOT token). A part starts where the previous part ended and ends at the first document
boundary at or after `tokens_per_part` tokens (or earlier: end of stream, output budget, full disk; those
may end it mid-document, which the next part continues from), so parts 0..K concatenated are the token
stream of one long run.

`manifest.json` in the output directory is rewritten atomically after every shard, so it is valid at any
moment: the finished shards with their sha256, and where the stream stands after each. A killed run
started again verifies those shards and carries on from the last one, producing the same bytes as an
uninterrupted run. Shards are written in a temporary directory outside the output and then moved in.

The pieces: `shared.tokenize.source` (the document stream), `shared.tokenize.workers` (the tokenizer
processes), `shared.tokenize.manifest` (the output directory and its manifest); this module holds the
settings and the run that ties them together.

Module-level imports are stdlib and numpy only; datasets, pyarrow, tiktoken and tqdm load inside functions.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from shared.config import GB, MANIFEST_SLACK, TokenizeConfig
from shared.data import write_shard
from shared.errors import UserError
from shared.fsutil import sha256_file
from shared.retry import Backoff, DeadlineReached
from shared.session_clock import seconds_left
from shared.tokenize.manifest import (
    DISK_SLACK,
    MANIFEST,
    MANIFEST_FORMAT,
    clean_leftovers,
    dir_bytes,
    find_prev_manifest,
    format_bytes,
    inspect_out_dir,
    move_into,
    read_manifest,
    shard_bytes,
    shard_name,
    shards_bytes,
    verify_shards,
    write_manifest,
)
from shared.tokenize.source import (
    describe_source,
    library_versions,
    open_stream,
    resolve_hub_revision,
    same_source,
    source_label,
    stream_batches,
)
from shared.tokenize.tokenizer import EOT_TOKEN, resolve_ranks_path
from shared.tokenize.workers import encode_docs, result_of, shut_down, start_pool

CRASH_ENV = "GPT2K_TOKENIZE_CRASH_AFTER_SHARDS"  # tests: die right after moving in the N-th new shard


class _Stop(Exception):
    """Ends the run from inside the shard loop (part full, budget or disk reached); `reason` goes to the manifest."""

    def __init__(self, reason: str):
        self.reason = reason


def tokenize_part(cfg: TokenizeConfig, log: Callable[[str], None] | None = None) -> dict:
    """Make (or finish) part `cfg.part` in `cfg.out_dir`; returns its manifest with a `summary` added."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_start = time.time()
    cfg.__post_init__()  # the checks again: a field may have been set since the config was built
    out_dir = Path(cfg.out_dir)
    source = describe_source(cfg)

    if cfg.part > 0:
        prev = find_prev_manifest(cfg.prev_dir, cfg.part)
        if source["kind"] == "hub" and not cfg.revision:
            source["revision"] = prev["source"].get("revision", "")
        diff = same_source(prev["source"], source)
        if diff:
            raise UserError(f"part {cfg.part - 1} was made from another source ({diff}); use the same flags")
        start = dict(prev["end"])
        first_shard_index = prev["first_shard_index"] + len(prev["shards"])
    else:
        start = {"doc": 0, "offset": 0, "checkpoint": {"doc": 0, "state": None, "text_sha": None}}
        first_shard_index = 0
    if source["kind"] == "hub" and cfg.part == 0:
        if (out_dir / MANIFEST).is_file():  # resuming: the snapshot the run started on, unless one is given
            source["revision"] = cfg.revision or read_manifest(out_dir / MANIFEST)["source"].get("revision", "")
        else:
            pin_backoff = Backoff(cfg.retry_wait_s, total_s=min(300.0, cfg.retry_total_s))
            source["revision"] = resolve_hub_revision(cfg.dataset, cfg.revision, pin_backoff, log)

    ranks = resolve_ranks_path(cfg.ranks_path or None)
    fresh = {
        "format": MANIFEST_FORMAT,
        "part": cfg.part,
        "complete": False,
        "stop_reason": None,
        "source": source,
        "libraries": library_versions(),
        "tokenizer": {
            "name": "gpt2", "library": "tiktoken", "method": "encode_ordinary", "eot_token": EOT_TOKEN,
            "eot": "before each document", "ranks_sha256": sha256_file(ranks) if ranks else None,
        },
        "shard_size": cfg.shard_size,
        "tokens_per_part": cfg.tokens_per_part,
        "prefix": cfg.prefix,
        "first_shard_index": first_shard_index,
        "start": start,
        "end": start,
        "num_tokens": 0,
        "num_docs": 0,
        "shards": [],
    }
    manifest = inspect_out_dir(out_dir, fresh, log)

    budget = int(cfg.max_output_gb * GB)
    existing = out_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < shard_bytes(cfg.shard_size) + DISK_SLACK:
        raise UserError(f"--out-dir {out_dir}: only {format_bytes(free)} free on its disk, less than one shard "
                        f"plus the {format_bytes(DISK_SLACK)} kept free")
    if cfg.tmp_dir and Path(cfg.tmp_dir).resolve().is_relative_to(out_dir.resolve()):
        raise UserError(f"--tmp-dir {cfg.tmp_dir}: must be outside --out-dir")

    created_dir = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    resumed = manifest is not fresh
    if resumed:
        clean_leftovers(out_dir, manifest)
        n_before = len(manifest["shards"])
        kept = verify_shards(out_dir, manifest, log)
        if manifest["complete"] and kept == n_before:
            log(f"part {cfg.part} in {out_dir} is already complete ({kept} shards verified)")
            manifest["summary"] = _summary(manifest, out_dir, 0.0, 0, resumed=True)
            return manifest
        if kept:
            last = manifest["shards"][-1]
            manifest["end"] = {**last["end"], "checkpoint": last["checkpoint"]}
        else:
            manifest["end"] = manifest["start"]
        manifest["num_tokens"] = sum(s["tokens"] for s in manifest["shards"])
        start, end = manifest["start"], manifest["end"]
        manifest["num_docs"] = docs_between(start, end)
        log(f"resuming part {cfg.part}: {kept} finished shards verified, continuing at document "
            f"{manifest['end']['doc']} (+{manifest['end']['offset']} tokens)")
    manifest_len = write_manifest(out_dir, manifest)
    try:
        return _produce(cfg, manifest, out_dir, source, ranks, budget, manifest_len, resumed, t_start, log)
    except UserError:
        if not resumed and not manifest["shards"]:  # a fresh run that made nothing: leave the directory as it was
            (out_dir / MANIFEST).unlink(missing_ok=True)
            if created_dir and not any(out_dir.iterdir()):
                out_dir.rmdir()
        raise


def _produce(cfg, manifest, out_dir, source, ranks, budget, manifest_len, resumed, t_start, log) -> dict:
    if cfg.tmp_dir:
        Path(cfg.tmp_dir).mkdir(parents=True, exist_ok=True)
    tmp_root = Path(tempfile.mkdtemp(prefix="tokenize-", dir=cfg.tmp_dir or None))
    processes = cfg.processes or os.cpu_count() or 1
    crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
    pool = None
    state = None
    t_run = time.time()
    try:
        state = _RunState(cfg, manifest, out_dir, tmp_root, budget, manifest_len, crash_after, log)
        pool = start_pool(processes, str(ranks) if ranks else None)
        end = manifest["end"]
        batches = stream_batches(lambda: open_stream(source), source, end["checkpoint"], cfg.batch_docs,
                                 first_doc=end["doc"], log=log, backoff=_stream_backoff(cfg))
        reason = state.run(pool, batches, processes)
    finally:
        if pool is not None:
            shut_down(pool, log=log)
        if state is not None:
            state.close_progress()
        shutil.rmtree(tmp_root, ignore_errors=True)
    if not manifest["shards"]:  # a part with no shard must not pass for a finished one
        if reason == "output_budget":
            raise UserError(f"--max-output-gb {cfg.max_output_gb:g}: no room for part {cfg.part}'s first shard "
                            f"({shard_bytes(cfg.shard_size):,} bytes) next to its manifest")
        if reason == "session_deadline":
            raise UserError(f"part {cfg.part}: the session's deadline ({cfg.session_deadline:g} s from its start) "
                            "passed before its first shard")
        if reason == "disk_full":
            raise UserError(f"part {cfg.part}: no disk room for its first shard ({shard_bytes(cfg.shard_size):,} "
                            f"bytes plus {format_bytes(DISK_SLACK)} kept free, on the output and temporary disks)")
        if cfg.part == 0:
            raise UserError(f"{source_label(source)}: no documents in the input")
        raise UserError(f"part {cfg.part - 1} ended where the stream does; there is no part {cfg.part}")
    manifest["complete"], manifest["stop_reason"] = True, reason
    write_manifest(out_dir, manifest)
    elapsed = time.time() - t_run
    manifest["summary"] = _summary(manifest, out_dir, elapsed, state.new_tokens, resumed=resumed,
                                   total_seconds=time.time() - t_start)
    return manifest


def _stream_backoff(cfg: TokenizeConfig) -> Backoff:
    """The stream's waits on Hub faults: none that would run past the session's deadline."""
    return Backoff(first_s=cfg.retry_wait_s, max_s=300.0, total_s=cfg.retry_total_s,
                   time_left=lambda: seconds_left(cfg.session_deadline))


def docs_between(start: dict, end: dict) -> int:
    """Documents begun between stream positions `start` and `end` (a part's count: one it starts inside of was
    counted by the part before)."""
    return end["doc"] - start["doc"] + (1 if end["offset"] else 0) - (1 if start["offset"] else 0)


def _summary(manifest: dict, out_dir: Path, seconds: float, new_tokens: int, resumed: bool,
             total_seconds: float | None = None) -> dict:
    return {
        "out_dir": str(out_dir),
        "part": manifest["part"],
        "shards": len(manifest["shards"]),
        "tokens": manifest["num_tokens"],
        "docs": manifest["num_docs"],
        "bytes": shards_bytes(manifest),
        "stop_reason": manifest["stop_reason"],
        "start": {k: manifest["start"][k] for k in ("doc", "offset")},
        "end": {k: manifest["end"][k] for k in ("doc", "offset")},
        "new_tokens": new_tokens,
        "seconds": seconds,
        "total_seconds": total_seconds if total_seconds is not None else seconds,
        "tokens_per_second": new_tokens / seconds if seconds > 0 else 0.0,
        "resumed": resumed,
    }


class _RunState:
    """The main loop's state: the shard being filled, where the stream stands, the manifest."""

    def __init__(self, cfg, manifest, out_dir, tmp_root, budget, manifest_len, crash_after, log):
        self.cfg, self.m, self.out_dir, self.tmp_root = cfg, manifest, out_dir, tmp_root
        self.budget, self.manifest_len, self.crash_after, self.log = budget, manifest_len, crash_after, log
        self.buf = np.empty(cfg.shard_size, dtype=np.uint16)
        self.fill = 0
        self.part_tokens = manifest["num_tokens"]  # tokens of this part consumed: in shards or in `buf`
        self.new_tokens = 0
        self.new_shards = 0
        self.written = shards_bytes(manifest)
        self.other_bytes = max(0, dir_bytes(out_dir) - self.written - manifest_len)
        self.drop_offset = manifest["end"]["offset"]  # tokens of the first document already in earlier shards
        self._last_end: dict | None = None
        self._last_ckpt: dict | None = None
        self.bar = None
        if cfg.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.tokens_per_part, initial=self.part_tokens, unit="tok", unit_scale=True,
                            desc=f"part {cfg.part}", dynamic_ncols=True, smoothing=0.05,
                            mininterval=0.5 if sys.stderr.isatty() else 30.0)  # a Kaggle log keeps every line

    def _postfix(self, end: dict) -> None:
        """The bar's documents so far (up to stream position `end`) and gigabytes written."""
        self.bar.set_postfix(docs=docs_between(self.m["start"], end), GB=f"{self.written / GB:.2f}", refresh=False)

    def close_progress(self) -> None:
        if self.bar is not None:
            self._postfix(self.m["end"])
            self.bar.close()
            self.bar = None

    def run(self, pool, batches, processes: int) -> str:
        """Tokenize batches in order on `pool` (a bounded number in flight) until the part or stream ends."""
        pending: deque = deque()
        max_pending = 2 * processes + 2
        if self.part_tokens >= self.cfg.tokens_per_part and not self.drop_offset:
            return "part_size"  # killed after the part's last shard was recorded, before it was marked complete
        deadline = f"the session's deadline ({self.cfg.session_deadline:g} s from its start)"
        try:
            reason = "end_of_stream"
            try:
                for first_doc, texts, ckpt in batches:
                    pending.append((first_doc, ckpt, pool.apply_async(encode_docs, (texts,))))
                    while len(pending) >= max_pending:
                        self._consume(*pending.popleft())
                    if seconds_left(self.cfg.session_deadline) <= 0:
                        self.log(f"stopping: {deadline} has come; the next part goes on from here")
                        reason = "session_deadline"
                        break
            except DeadlineReached as err:  # waiting out a Hub fault would run past it
                self.log(f"stopping: {deadline} comes before the next try ({err}); the next part goes on from here")
                reason = "session_deadline"
            while pending:
                self._consume(*pending.popleft())
            if self.fill:
                self._finish_shard(self._last_end, self._last_ckpt)
            return reason
        except _Stop as stop:
            return stop.reason

    def _consume(self, first_doc: int, ckpt: dict, result) -> None:
        tokens, lengths = result_of(result)
        dropped = self.drop_offset  # resuming inside a document: its first tokens are in the previous shard
        if dropped:
            tokens, lengths = tokens[dropped:], lengths.copy()
            lengths[0] -= dropped
            self.drop_offset = 0
        ends = np.cumsum(lengths)
        part_done = False
        remaining = self.cfg.tokens_per_part - self.part_tokens
        if ends[-1] >= remaining:  # the part ends with the document that reaches its token count
            last = int(np.searchsorted(ends, remaining, side="left"))
            ends = ends[:last + 1]
            tokens = tokens[:int(ends[-1])]
            part_done = True
        pos, total = 0, len(tokens)
        while pos < total:
            take = min(self.cfg.shard_size - self.fill, total - pos)
            self.buf[self.fill:self.fill + take] = tokens[pos:pos + take]
            self.fill += take
            pos += take
            if self.fill == self.cfg.shard_size:
                idx = int(np.searchsorted(ends, pos, side="right"))
                # Offsets count from the document's start: in the first document, past its dropped tokens too.
                offset = pos - int(ends[idx - 1]) if idx else dropped + pos
                self._finish_shard({"doc": first_doc + idx, "offset": offset}, ckpt)
        self.part_tokens += total
        self._last_end = {"doc": first_doc + len(ends), "offset": 0}
        self._last_ckpt = ckpt
        if self.bar is not None:
            self.bar.update(total)
            self._postfix(self._last_end)
        if part_done:
            if self.fill:
                self._finish_shard(self._last_end, ckpt)
            raise _Stop("part_size")

    def _finish_shard(self, end: dict, ckpt: dict) -> None:
        """Write the buffer's tokens as the next shard, which ends at stream position `end`."""
        n = self.fill
        nbytes = shard_bytes(n)
        used = self.written + self.manifest_len + self.other_bytes
        if used + nbytes + MANIFEST_SLACK > self.budget:
            self.log(f"stopping: the next shard ({format_bytes(nbytes)}) would take the output past "
                     f"--max-output-gb {self.cfg.max_output_gb:g} ({format_bytes(used)} used)")
            raise _Stop("output_budget")
        for where in (self.out_dir, self.tmp_root):
            if shutil.disk_usage(where).free < nbytes + DISK_SLACK:
                self.log(f"stopping: {where} has no room for the next shard ({format_bytes(nbytes)})")
                raise _Stop("disk_full")
        m = self.m
        index = m["first_shard_index"] + len(m["shards"])
        name = shard_name(self.cfg.prefix, index)
        tmp = self.tmp_root / name
        write_shard(tmp, self.buf[:n])
        sha = sha256_file(tmp)
        move_into(tmp, self.out_dir / name)
        self.new_shards += 1
        if self.crash_after and self.new_shards >= self.crash_after:
            os._exit(137)  # tests: a kill between moving a shard in and recording it in the manifest
        m["shards"].append({
            "name": name,
            "split": "val" if index == 0 else "train",
            "tokens": n,
            "sha256": sha,
            "end": dict(end),
            "checkpoint": ckpt,
        })
        m["end"] = {"doc": end["doc"], "offset": end["offset"], "checkpoint": ckpt}
        m["num_tokens"] += n
        m["num_docs"] = docs_between(self.m["start"], end)
        self.written += nbytes
        self.new_tokens += n  # tokens this run put into shards (what its summary and tokens/s count)
        self.fill = 0
        self.manifest_len = write_manifest(self.out_dir, m)
