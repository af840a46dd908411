"""Benchmark: the tokenize kernel end to end vs raw tiktoken on the same texts and the same process count.

    python scripts/bench_tokenize.py                      # ~64 MB generated parquet corpus, one process per core
    python scripts/bench_tokenize.py --mb 200 --processes 8 --repeat 3
    python scripts/bench_tokenize.py --hub                # the kernel on local files vs through a local Hub
    python scripts/bench_tokenize.py --hub --hub-slow-mbps 50   # ... with the Hub's parquet bytes at 50 Mbit/s

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

With `--hub` the same documents, in the same order, are also written as a FineWeb-Edu-shaped dataset repo
(`scripts/local_hub.py`: sample/10BT/NNN_00000.parquet, its columns, row groups of `--hub-row-group-rows`) served
by a local Hugging Face Hub, and `kernels/tokenize.py` runs as a subprocess (huggingface_hub reads HF_ENDPOINT at
import) twice per repeat with the same flags: on the local parquet files (`--data-files`), and on the dataset's
default (HuggingFaceFW/fineweb-edu, sample-10BT) through HF_ENDPOINT, reading the files with HTTP Range requests.
Both runs' wall and CPU times are taken less the start-up a kernel pays once (an interpreter that only imports
what the kernel imports, timed alone); CPU is the kernel's (its process and its pool, reaped) plus this
process's (the local Hub's threads; nothing in the local run). `--hub-slow-mbps` serves the parquet bytes at
that rate (the Hub's `slow` fault): the link as the bottleneck.

Both modes end with an extrapolation of the measured tokens per CPU-second to Kaggle CPU sessions (4 cores,
12 hours, the kernel's `session_deadline`).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
for _var in ("USE_TORCH", "USE_TF", "USE_JAX"):  # as kernels/tokenize.py: keep torch out of `datasets`
    os.environ.setdefault(_var, "0")

from scripts.local_hub import LocalHub, build_fineweb_like  # noqa: E402
from shared.config import TokenizeConfig  # noqa: E402
from shared.tokenize.part import tokenize_part  # noqa: E402
from shared.tokenize.tokenizer import fetch_gpt2_ranks, gpt2_encoding  # noqa: E402

_TEXTS: list[str] = []
_ENC = None
ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "kernels" / "tokenize.py"
# What a kernel process imports before its first document, timed alone and taken off both kernel runs.
STARTUP = ("import os\nfor v in ('USE_TORCH', 'USE_TF', 'USE_JAX'): os.environ.setdefault(v, '0')\n"
           "import datasets, huggingface_hub, pyarrow.parquet, tiktoken, shared.tokenize.part")
KAGGLE_CORES = 4  # a Kaggle CPU session
KAGGLE_SESSION_S = 12 * 3600
TARGETS = (5e9, 10e9, 40e9)


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


@dataclass
class KernelRun:
    wall: float  # seconds, the whole subprocess
    kernel_cpu: float  # the subprocess and its reaped pool
    hub_cpu: float  # this process meanwhile: the local Hub's threads
    tokens: int
    stdout: str
    log: list[dict]  # the Hub's requests during the run

    @property
    def cpu(self) -> float:
        return self.kernel_cpu + self.hub_cpu


def _own_cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def _kids_cpu() -> float:
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return kids.ru_utime + kids.ru_stime


def hub_env(url: str, hf_home: Path) -> dict[str, str]:
    """The environment both kernel runs get: the local Hub as the endpoint, a fresh HF_HOME, no telemetry."""
    return {**os.environ, "HF_ENDPOINT": url, "HF_HOME": str(hf_home), "HF_UPDATE_DOWNLOAD_COUNTS": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def run_timed(cmd: list[str], env: dict[str, str], hub: LocalHub | None = None) -> KernelRun:
    """Run `cmd` in the repository; its wall time, its CPU (with its reaped children), this process's CPU meanwhile,
    its stdout and the Hub requests it made (tokens left 0). A failed run stops the benchmark with its output."""
    n_log = len(hub.log) if hub else 0
    own0, kids0, t0 = _own_cpu(), _kids_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall, kids, own = time.perf_counter() - t0, _kids_cpu() - kids0, _own_cpu() - own0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return KernelRun(wall, kids, own, 0, proc.stdout, list(hub.log[n_log:]) if hub else [])


def bench_startup(env: dict[str, str]) -> tuple[float, float]:
    """Wall and CPU seconds of an interpreter that only imports what the kernel imports."""
    run = run_timed([sys.executable, "-c", STARTUP], env)
    return run.wall, run.kernel_cpu


def bench_kernel_process(flags: list[str], env: dict[str, str], out: Path, hub: LocalHub) -> KernelRun:
    """`kernels/tokenize.py` as a subprocess with `flags`; its output directory is removed afterwards."""
    shutil.rmtree(out, ignore_errors=True)
    run = run_timed([sys.executable, str(KERNEL), "--out-dir", str(out), "--tmp-dir", str(out.parent / "tmp"),
                     "--no-progress", *flags], env, hub)
    run.tokens = json.loads((out / "manifest.json").read_text())["num_tokens"]
    shutil.rmtree(out, ignore_errors=True)
    return run


def parquet_fetched(log: list[dict], sizes: dict[str, int]) -> tuple[int, int]:
    """Parquet GET requests in a Hub log and the bytes they asked for (an open range: to the file's end)."""
    gets, total = 0, 0
    for entry in log:
        name = entry["path"].rsplit("/", 1)[-1]
        if entry["method"] != "GET" or name not in sizes:
            continue
        gets += 1
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", entry.get("range") or "")
        lo, hi = (int(m.group(1)), int(m.group(2)) + 1 if m.group(2) else sizes[name]) if m else (0, sizes[name])
        total += min(hi, sizes[name]) - lo
    return gets, total


def build_hub_repo(root: Path, files: int, row_group_rows: int) -> dict[str, int]:
    """`_TEXTS`, in order, as the local Hub's FineWeb-Edu repo; its parquet files' sizes. Prints their shape."""
    import pyarrow.parquet as pq

    repo = build_fineweb_like(root, _TEXTS, files=files, row_group_rows=row_group_rows)
    paths = sorted((repo / "sample" / "10BT").glob("*.parquet"))
    sizes = {p.name: p.stat().st_size for p in paths}
    groups = [pq.ParquetFile(p).metadata.num_row_groups for p in paths]
    print(f"hub repo: HuggingFaceFW/fineweb-edu, sample/10BT: {len(paths)} parquet files of "
          f"{min(sizes.values()) / 1e6:.1f}-{max(sizes.values()) / 1e6:.1f} MB ({sum(sizes.values()) / 1e6:.1f} MB), "
          f"{min(groups)}-{max(groups)} row groups of up to {row_group_rows:,} rows "
          f"(~{sum(sizes.values()) / sum(groups) / 1e6:.1f} MB) each, all ten FineWeb-Edu columns")
    return sizes


def _this_run(stdout: str) -> str:
    m = re.search(r"this run: .*", stdout)
    return m.group(0) if m else "(no 'this run' line)"


def bench_hub(args: argparse.Namespace, paths: list[Path], processes: int, ranks: str) -> float:
    """The kernel on the local parquet files vs through the local Hub, side by side; returns the Hub run's tokens
    per CPU-second (kernel and Hub, less start-up)."""
    with tempfile.TemporaryDirectory(prefix="bench_tokenize_hub_") as tmp_name:
        tmp = Path(tmp_name)
        sizes = build_hub_repo(tmp / "hub", args.files, args.hub_row_group_rows)
        hub = LocalHub(tmp / "hub").start()
        try:
            if args.hub_slow_mbps:
                hub.add_fault("slow", match=".parquet", count=10**9, bytes_per_s=int(args.hub_slow_mbps * 1e6 / 8))
                print(f"hub link: parquet bodies served at {args.hub_slow_mbps:g} Mbit/s "
                      f"({args.hub_slow_mbps / 8:g} MB/s; the local Hub's 'slow' fault)")
            flags = ["--shard-size", str(args.shard_size), "--processes", str(processes), "--batch-docs",
                     str(args.batch_docs), "--ranks-path", ranks]
            bench_startup(hub_env(hub.url, tmp / "hf-home-warm-up"))  # a warm-up: the first imports read a cold disk
            best: dict[str, list] = {"startup": [], "local": [], "hub": []}
            for r in range(args.repeat):
                for name, value in _hub_repeat(r, flags, paths, hub, tmp, sizes).items():
                    best[name].append(value)
        finally:
            hub.stop()
    return _hub_summary(best, sizes, args.repeat)


def _hub_repeat(r: int, flags: list[str], paths: list[Path], hub: LocalHub, tmp: Path,
                sizes: dict[str, int]) -> dict:
    """One start-up, one local and one hub run (each with a fresh HF_HOME); prints them."""
    startup = bench_startup(hub_env(hub.url, tmp / f"hf-home-{r}-startup"))
    local = bench_kernel_process([*flags, "--data-files", ",".join(map(str, paths))],
                                 hub_env(hub.url, tmp / f"hf-home-{r}-local"), tmp / "out", hub)
    remote = bench_kernel_process(flags, hub_env(hub.url, tmp / f"hf-home-{r}-hub"), tmp / "out", hub)
    assert local.tokens == remote.tokens, (local.tokens, remote.tokens)
    assert not local.log, local.log[:3]  # the local run must not touch the Hub
    gets, fetched = parquet_fetched(remote.log, sizes)
    print(f"run {r + 1}: start-up {startup[0]:.2f}s wall, {startup[1]:.2f}s CPU; the hub run made {len(remote.log)} "
          f"requests, {gets} parquet GETs for {fetched / 1e6:.1f} MB (the files: {sum(sizes.values()) / 1e6:.1f} MB)")
    for name, run in (("local", local), ("hub", remote)):
        print(f"  {name + ':':6s} {run.wall:5.2f}s wall, {run.kernel_cpu:5.2f}s kernel CPU + {run.hub_cpu:.2f}s hub "
              f"CPU; the kernel's {_this_run(run.stdout)}")
    net = [(run.wall - startup[0], run.cpu - startup[1]) for run in (remote, local)]
    print(f"  hub / local, less this start-up: {net[1][0] / net[0][0]:.1%} wall-clock, {net[1][1] / net[0][1]:.1%} "
          "CPU-time", flush=True)
    return {"startup": startup, "local": local, "hub": remote}


def _hub_summary(best: dict[str, list], sizes: dict[str, int], repeat: int) -> float:
    """Best-of wall and CPU for both, less the best start-up; the ratio; the link the CPU rate would need."""
    start_wall, start_cpu = min(w for w, _ in best["startup"]), min(c for _, c in best["startup"])
    tokens = best["hub"][0].tokens
    rate = {name: tokens / max(min(r.wall for r in best[name]) - start_wall, 1e-9) for name in ("local", "hub")}
    per_cpu = {name: tokens / max(min(r.cpu for r in best[name]) - start_cpu, 1e-9) for name in ("local", "hub")}
    hub_run = min(best["hub"], key=lambda r: r.cpu)
    print(f"tokens: {tokens:,} a run; best of {repeat}, less start-up ({start_wall:.2f}s wall, {start_cpu:.2f}s CPU); "
          f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for name, label in (("local", "kernel on local parquet files"), ("hub", "kernel through the local Hub")):
        print(f"{label + ':':38s} {rate[name] / 1e6:6.2f}M tokens/s wall, "
              f"{per_cpu[name] / 1e6:5.2f}M tokens per CPU-second")
    print(f"ratio hub / local: {rate['hub'] / rate['local']:.1%} wall-clock, {per_cpu['hub'] / per_cpu['local']:.1%} "
          f"CPU-time (the local Hub's own threads: {hub_run.hub_cpu / hub_run.cpu:.1%} of the hub run's CPU)")
    fetched = parquet_fetched(hub_run.log, sizes)[1]
    need = per_cpu["hub"] * KAGGLE_CORES * fetched / tokens
    print(f"parquet read from the Hub: {fetched / tokens:.2f} bytes a token on this corpus; {KAGGLE_CORES} cores at "
          f"the hub rate per CPU-second would need {need / 1e6:.1f} MB/s ({need * 8 / 1e6:.0f} Mbit/s) of it")
    return per_cpu["hub"]


def print_extrapolation(label: str, tokens_per_cpu_s: float) -> None:
    """Hours and 12-hour Kaggle CPU sessions that TARGETS tokens would take at `tokens_per_cpu_s` a core."""
    cfg = TokenizeConfig()
    usable_s = cfg.session_deadline
    rate = tokens_per_cpu_s * KAGGLE_CORES
    print(f"extrapolation from this machine's figures, not a measurement on Kaggle: {label} at "
          f"{tokens_per_cpu_s / 1e6:.2f}M tokens per CPU-second")
    print(f"  assumes a Kaggle CPU session's {KAGGLE_CORES} cores, each as fast as one here, tokens/s scaling with "
          f"cores ({rate / 1e6:.1f}M tokens/s), {usable_s / 3600:g} h of tokenizing a {KAGGLE_SESSION_S // 3600}-hour "
          f"session (session_deadline {usable_s:,.0f} s: {(KAGGLE_SESSION_S - usable_s) / 3600:g} h unused)")
    for n in TARGETS:
        seconds = n / rate
        parts = math.ceil(n / cfg.tokens_per_part)
        print(f"  {n / 1e9:4g}B tokens: {seconds / 3600:6.2f} h, {math.ceil(seconds / usable_s)} session(s) by time; "
              f"{parts} part(s) of at most {cfg.tokens_per_part / 1e9:g}B tokens (one kernel run each)")


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
    ap.add_argument("--hub", action="store_true", help="the kernel (a subprocess) on the local parquet files vs "
                    "through a local Hugging Face Hub serving the same documents")
    ap.add_argument("--hub-row-group-rows", type=int, default=1000, help="--hub: documents per parquet row group")
    ap.add_argument("--hub-slow-mbps", type=float, default=0, help="--hub: serve the parquet bytes at this many "
                    "megabits per second (0: as fast as the loopback goes)")
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
    if args.hub:
        label = "the kernel through the local Hub" + (" (CPU time only: the slow link is not in it)"
                                                        if args.hub_slow_mbps else "")
        print_extrapolation(label, bench_hub(args, paths, processes, ranks))
        return
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
    print_extrapolation("the kernel end to end on local files", tokens / cpu["kernel"])


if __name__ == "__main__":
    main()
