"""Benchmark: the tokenize kernel end to end vs raw tiktoken on the same texts and the same process count.

    python scripts/bench_tokenize.py                      # ~64 MB generated parquet corpus, one process per core
    python scripts/bench_tokenize.py --mb 200 --processes 8 --repeat 3

The corpus is English text (paragraphs of Python's help topics, shuffled into documents of FineWeb-Edu-like
length) written as parquet files. Measured, best of `--repeat` alternating runs:

- kernel: `shared.tokenize.part.tokenize_part` on the parquet files (datasets streaming, the process pool,
  shards written to disk, sha256, manifest), wall time of the whole call; the Python imports it needs are
  done beforehand, as they are a constant paid once per kernel.
- raw: the same texts already in memory, `encode_ordinary_batch` on a pool of the same number of processes
  (each worker encodes slices of a list inherited by fork and returns only a count).
- raw_np: the same with `encode_to_numpy`, the call the kernel's workers make (no Python list per
  document); kernel / raw_np is the cost of everything around the BPE: reading, IPC, shards, hashes.

Both wall-clock tokens/s and tokens per CPU-second (this process and its pool workers) are reported; on a
machine shared with other work the CPU-time ratio is the steadier of the two.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for _var in ("USE_TORCH", "USE_TF", "USE_JAX"):  # as kernels/tokenize.py: keep torch out of `datasets`
    os.environ.setdefault(_var, "0")

from shared.config import TokenizeConfig  # noqa: E402
from shared.tokenize.part import tokenize_part  # noqa: E402
from shared.tokenize.tokenizer import fetch_gpt2_ranks, gpt2_encoding  # noqa: E402

_TEXTS: list[str] = []
_ENC = None


def make_corpus(out: Path, mb: float, files: int, seed: int = 0) -> list[Path]:
    """Parquet files totalling about `mb` MB of text; reused when the same spec already exists."""
    from pydoc_data.topics import topics

    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = f"mb={mb} files={files} seed={seed}"
    paths = [out / f"bench-{i:03d}.parquet" for i in range(files)]
    if (out / "SPEC").is_file() and (out / "SPEC").read_text() == spec and all(p.is_file() for p in paths):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    paras = [p.strip() for text in topics.values() for p in text.split("\n\n") if len(p.strip()) > 40]
    rng = random.Random(seed)
    docs, total = [], 0
    while total < mb * 1e6:
        n = max(1, int(rng.lognormvariate(2.3, 0.8)))  # ~10 paragraphs, long tail: ~4.5 KB documents
        doc = "\n\n".join(rng.choice(paras) for _ in range(n))
        docs.append(doc)
        total += len(doc.encode())
    per = -(-len(docs) // files)
    for i, path in enumerate(paths):
        chunk = docs[i * per:(i + 1) * per]
        pq.write_table(pa.table({"id": list(range(i * per, i * per + len(chunk))), "text": chunk}), path,
                       row_group_size=1000)
    (out / "SPEC").write_text(spec)
    return paths


def _raw_init(ranks: str) -> None:
    global _ENC
    _ENC = gpt2_encoding(ranks)


def _raw_count(bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    return sum(len(t) for t in _ENC.encode_ordinary_batch(_TEXTS[lo:hi], num_threads=1))


def _raw_count_numpy(bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    return sum(_ENC.encode_to_numpy(t, disallowed_special=()).size for t in _TEXTS[lo:hi])


def _cpu_seconds() -> float:
    """CPU time of this process and of its reaped children (the pool workers, once joined)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def bench_raw(processes: int, batch: int, ranks: str, numpy: bool = False) -> tuple[float, float, int]:
    c0, t0 = _cpu_seconds(), time.perf_counter()
    pool = multiprocessing.get_context("fork").Pool(processes, initializer=_raw_init, initargs=(ranks,))
    chunks = [(i, min(i + batch, len(_TEXTS))) for i in range(0, len(_TEXTS), batch)]
    tokens = sum(pool.imap(_raw_count_numpy if numpy else _raw_count, chunks, chunksize=4))
    pool.close()
    pool.join()
    return time.perf_counter() - t0, _cpu_seconds() - c0, tokens


def bench_kernel(paths: list[Path], processes: int, batch: int, ranks: str, shard_size: int, tmp: Path):
    out = tmp / "out"
    shutil.rmtree(out, ignore_errors=True)
    cfg = TokenizeConfig(data_files=",".join(map(str, paths)), out_dir=str(out), processes=processes,
                         batch_docs=batch, ranks_path=ranks, shard_size=shard_size, progress=False,
                         tmp_dir=str(tmp / "tmp"))
    c0, t0 = _cpu_seconds(), time.perf_counter()
    manifest = tokenize_part(cfg, log=lambda msg: None)
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    shutil.rmtree(out, ignore_errors=True)
    return seconds, cpu, manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-dir", default=os.path.join(tempfile.gettempdir(), "bench_tokenize_corpus"))
    ap.add_argument("--mb", type=float, default=64, help="corpus size in MB of UTF-8 text")
    ap.add_argument("--files", type=int, default=4, help="parquet files")
    ap.add_argument("--processes", type=int, default=0, help="processes for both (0: one per core)")
    ap.add_argument("--batch-docs", type=int, default=256, help="documents per task, both")
    ap.add_argument("--shard-size", type=int, default=10_000_000, help="kernel shard size in tokens")
    ap.add_argument("--repeat", type=int, default=3, help="alternating runs of each; the best counts")
    ap.add_argument("--ranks-path", default="", help="GPT-2 ranks file (default: fetched to the cache)")
    args = ap.parse_args()
    global _TEXTS
    import datasets  # noqa: F401 - imported up front: a once-per-kernel constant, not throughput
    import pyarrow.parquet as pq

    ranks = args.ranks_path or str(fetch_gpt2_ranks())
    processes = args.processes or os.cpu_count() or 1
    paths = make_corpus(Path(args.corpus_dir), args.mb, args.files)
    _TEXTS = [t for p in paths for t in pq.read_table(p, columns=["text"]).column("text").to_pylist()]
    mb = sum(len(t.encode()) for t in _TEXTS) / 1e6
    print(f"corpus: {len(_TEXTS):,} documents, {mb:.1f} MB of text in {len(paths)} parquet files "
          f"({args.corpus_dir}); {processes} processes, {args.batch_docs} documents per task, "
          f"{os.cpu_count()} CPU cores")
    names = {"raw": "raw tiktoken encode_ordinary_batch", "raw_np": "raw tiktoken encode_to_numpy",
             "kernel": "tokenize kernel end to end"}
    wall = dict.fromkeys(names, float("inf"))
    cpu = dict.fromkeys(names, float("inf"))
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_") as tmp:
        for r in range(args.repeat):
            row = {}
            for name in names:
                if name == "kernel":
                    s, c, manifest = bench_kernel(paths, processes, args.batch_docs, ranks, args.shard_size, Path(tmp))
                    tokens = manifest["num_tokens"]  # = raw tokens + one EOT per document
                else:
                    s, c, raw_tokens = bench_raw(processes, args.batch_docs, ranks, numpy=name == "raw_np")
                wall[name], cpu[name] = min(wall[name], s), min(cpu[name], c)
                row[name] = (s, c)
            assert tokens == raw_tokens + len(_TEXTS), (tokens, raw_tokens, len(_TEXTS))
            print(f"run {r + 1}: " + "   ".join(f"{n} {tokens / s / 1e6:5.2f}M tok/s ({s:.2f}s wall, {c:.2f}s CPU)"
                                                for n, (s, c) in row.items()), flush=True)
    print(f"tokens: {tokens:,} (incl. one <|endoftext|> per document); load average now "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, label in names.items():
        print(f"{label + ':':38s} {tokens / wall[name] / 1e6:6.2f}M tokens/s wall, "
              f"{tokens / cpu[name] / 1e6:5.2f}M tokens per CPU-second")
    for base in ("raw", "raw_np"):
        print(f"ratio kernel / {names[base]}: {wall[base] / wall['kernel']:.1%} wall-clock, "
              f"{cpu[base] / cpu['kernel']:.1%} CPU-time (goal >= 85%)")


if __name__ == "__main__":
    main()
