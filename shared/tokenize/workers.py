"""The tokenizer processes: each turns a batch of documents into EOT-prefixed GPT-2 tokens (tiktoken).

The encoding is loaded once per process (`init_worker`, the pool's initializer), not sent with every task.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable

import numpy as np

from shared.errors import UserError, describe_error
from shared.tokenize.tokenizer import EOT_TOKEN

_ENC = None


# The longest a batch may take a worker: a few hundred documents take well under a second; a worker that was
# killed (out of memory) loses its task for good, and the pool would wait for it until Kaggle ends the session.
RESULT_TIMEOUT_S = 600.0


def init_worker(ranks_path: str | None) -> None:
    """Load the encoding once per process rather than pickle it with every task: in the parent before the pool
    forks (its workers inherit it, so no worker downloads or fails on its own), or as the initializer where
    processes are spawned."""
    global _ENC
    from shared.tokenize.tokenizer import gpt2_encoding

    _ENC = gpt2_encoding(ranks_path)


def start_pool(processes: int, ranks_path: str | None):
    """A pool of tokenizer processes with the encoding loaded: a ranks file that will not load is one error here,
    not workers failing in their initializer, which the pool would respawn forever."""
    context = pool_context()
    try:
        init_worker(ranks_path)
    except UserError:
        raise
    except Exception as err:  # noqa: BLE001 - a damaged ranks file, or tiktoken's download failing: one line
        raise UserError(f"GPT-2's tokenizer could not be loaded ({describe_error(err)})") from None
    if context.get_start_method() == "fork":
        return context.Pool(processes)
    return context.Pool(processes, initializer=init_worker, initargs=(ranks_path,))


def result_of(result, timeout_s: float = RESULT_TIMEOUT_S):
    """A task's result, or one line once it has taken `timeout_s`."""
    try:
        return result.get(timeout_s)
    except multiprocessing.TimeoutError:
        raise UserError(f"a tokenizer process returned nothing within {timeout_s:g}s (killed, out of memory?); "
                        "run the part again: its finished shards are kept") from None


def encode_docs(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, lengths): each text as EOT + encode_ordinary(text), concatenated as uint16; per-doc lengths.

    `encode_to_numpy` with no special tokens allowed or disallowed gives exactly `encode_ordinary`'s tokens
    (a literal "<|endoftext|>" in a text is plain text), without building a Python list per document:
    that list is most of the gap between tiktoken's raw speed and a shard on disk.
    """
    enc = _ENC
    if not hasattr(enc, "encode_to_numpy"):  # tiktoken < 0.8
        return _encode_docs_lists(texts)
    parts: list[np.ndarray] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        try:
            ids = enc.encode_to_numpy(text, disallowed_special=())
        except UnicodeEncodeError:  # lone surrogates: encode_ordinary knows how to repair them
            ids = np.asarray(enc.encode_ordinary(text), dtype=np.uint32)
        parts.append(_EOT_ARRAY)
        parts.append(ids)
        lengths[i] = ids.size + 1
    tokens = np.concatenate(parts).astype(np.uint16) if parts else np.zeros(0, dtype=np.uint16)
    return tokens, lengths


_EOT_ARRAY = np.array([EOT_TOKEN], dtype=np.uint32)


def _encode_docs_lists(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    toks = _ENC.encode_ordinary_batch(texts, num_threads=1)
    lengths = np.fromiter((len(t) + 1 for t in toks), dtype=np.int64, count=len(toks))
    out = np.empty(int(lengths.sum()), dtype=np.uint16)
    pos = 0
    for t, n in zip(toks, lengths.tolist(), strict=True):
        out[pos] = EOT_TOKEN
        out[pos + 1:pos + n] = t
        pos += n
    return out, lengths


def pool_context() -> multiprocessing.context.BaseContext:
    """fork where the platform has it: workers start at once with the parent's imports, not re-importing __main__
    (a built kernel's __main__ is its whole file, or a notebook with no file at all)."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def shut_down(pool, wait_s: float = 60.0, log: Callable[[str], None] = print) -> None:
    """Terminate `pool`, waiting at most wait_s. CPython's Pool.terminate can wait forever on its task queue's
    lock after a fork from a process with threads (seen once in the test suite: the task handler stuck in
    SimpleQueue.put, terminate joining it); then the workers are killed and the stuck (daemon) handler thread
    is left behind, instead of the session hanging until Kaggle ends it."""
    terminator = threading.Thread(target=pool.terminate, daemon=True)
    terminator.start()
    terminator.join(wait_s)
    if terminator.is_alive():
        log(f"notice: the tokenizer pool did not stop within {wait_s:g}s; its workers are killed")
        for worker in list(getattr(pool, "_pool", [])):
            worker.kill()
        return
    pool.join()
