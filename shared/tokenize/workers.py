"""The tokenizer processes: each turns a batch of documents into EOT-prefixed GPT-2 tokens (tiktoken).

The encoding is loaded once per process (`init_worker`, the pool's initializer), not sent with every task.
"""

from __future__ import annotations

import multiprocessing

import numpy as np

from shared.tokenize.tokenizer import EOT_TOKEN

_ENC = None


def init_worker(ranks_path: str | None) -> None:
    """The pool's initializer: load the encoding once per process rather than pickle it with every task."""
    global _ENC
    from shared.tokenize.tokenizer import gpt2_encoding

    _ENC = gpt2_encoding(ranks_path)


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
    """forkserver where the platform has it, else spawn: never fork this process itself. A forked child of a
    process with threads (torch_xla's, the dataset reader's, an earlier pool's) can inherit a lock some thread
    held, and the pool then hangs at its end (seen in the test suite: `Pool.terminate` waiting forever on the
    task queue's lock). Workers import only this module and tiktoken."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
