"""Tokens to quality, fairly: Muon + wsd against an AdamW control with the same groups, schedule and LRs but for
the matrices' update rule, a small GPT-2 trained by the project's trainer on a real-text corpus built offline,
several seeds, validation loss curves side by side (PNG + table), and the tokens Muon needs to reach the control's
final validation loss, claimed only where the seeds' spreads do not overlap.

    python scripts/bench_recipe.py                # the corpus, then seeds x (controls + Muon budgets) runs
    python scripts/bench_recipe.py --text-dir DIR # any folder of .txt/.rst/.md/.html/.pod files instead
    python scripts/bench_recipe.py --compare      # Muon's settings side by side (the recipe's against others)

The corpus (about 26M GPT-2 tokens): the English documentation Debian ships in four packages fetched with
`apt-get download` (no root, the package index only): the Linux kernel's Documentation (reStructuredText),
Python's and PostgreSQL's manuals (HTML), Perl's pod pages. Documents are split into train/validation by a
fixed shuffle, so the validation text is unseen; every run sees at most one pass of the training text.

The two arms differ only in how the blocks' matrices are updated: both train the embeddings (so the tied head),
biases and gains with the same AdamW at --adamw-lr, both follow the same wsd schedule, and the control's matrices
take AdamW at each of --matrix-lrs (the project's `--matrix-lr`: the same optimizer groups and AdamW code as
Muon's AdamW part); the best of those controls is the target. Each seed gives every arm the same initialisation
and data order (a paired comparison). Muon's schedule decays to zero at its end, so Muon also trains at
fractions of the budget (each with its own decay), and the tokens it needs are read from those runs' final
losses, seed by seed.
"""

from __future__ import annotations

import argparse
import gzip
import html.parser
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.errors import UserError, run_cli  # noqa: E402

DEBIAN_PACKAGES = ("linux-doc-6.1", "python3.11-doc", "postgresql-doc-15", "perl-doc")
TEXT_SUFFIXES = (".rst", ".txt", ".md", ".html", ".pod")
SKIP_PARTS = {"translations", "devicetree", "_sources", "_static", "_images", "search"}


class _HtmlText(html.parser.HTMLParser):
    """The visible text of an HTML page (no scripts, styles or navigation bars)."""

    SKIP = {"script", "style", "nav", "head"}

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skipping = 0

    def handle_starttag(self, tag, attrs):
        self._skipping += tag in self.SKIP

    def handle_endtag(self, tag):
        self._skipping -= tag in self.SKIP and self._skipping > 0

    def handle_data(self, data):
        if not self._skipping:
            self.parts.append(data)


def document_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if ".html" in path.suffixes:
        parser = _HtmlText()
        parser.feed(text)
        text = "".join(parser.parts)
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def text_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*")):
        suffixes = [s for s in path.suffixes if s != ".gz"]
        if path.is_file() and suffixes and suffixes[-1] in TEXT_SUFFIXES and not SKIP_PARTS & set(path.parts):
            files.append(path)
    return files


def fetch_debian_docs(dest: Path) -> Path:
    """Download and unpack DEBIAN_PACKAGES into dest (apt-get download needs no root)."""
    if not shutil.which("apt-get") or not shutil.which("dpkg-deb"):
        raise UserError("building the corpus needs apt-get and dpkg-deb (Debian/Ubuntu); elsewhere pass "
                        "--text-dir DIR, a folder of English .txt/.rst/.md/.html files (tens of MB)")
    debs = dest / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    for package in DEBIAN_PACKAGES:
        proc = subprocess.run(["apt-get", "download", package], cwd=debs, capture_output=True, text=True)
        if proc.returncode:
            raise UserError(f"apt-get download {package} failed: {proc.stderr.strip().splitlines()[-1:]}")
    tree = dest / "tree"
    for deb in sorted(debs.glob("*.deb")):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tree)], check=True)
    return tree


def build_corpus(out: Path, text_dir: Path | None, val_fraction: float = 0.01, shard_tokens: int = 10_000_000,
                 seed: int = 0) -> dict:
    """Token shards (`bench_train_*.bin`, `bench_val_000000.bin`) from the documents under text_dir (default:
    Debian's documentation), documents shuffled once and split into train and validation."""
    from tqdm import tqdm

    from shared.tokenize.demo_corpus import eot_tokens, write_split_shards
    from shared.tokenize.tokenizer import gpt2_encoding

    summary_path = out / "corpus.json"
    if summary_path.exists():
        return json.loads(summary_path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        root = text_dir or fetch_debian_docs(Path(tmp))
        files = text_files(root)
        if not files:
            raise UserError(f"--text-dir {root}: no {'/'.join(TEXT_SUFFIXES)} files found")
        docs = [d for f in tqdm(files, desc="reading", unit="file") if len(d := document_text(f)) > 500]
    random.Random(seed).shuffle(docs)
    n_val = max(1, int(len(docs) * val_fraction))
    enc = gpt2_encoding()
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, part in (("val", docs[:n_val]), ("train", docs[n_val:])):
        tokens = eot_tokens(enc, part, num_threads=os.cpu_count() or 1)
        write_split_shards(out, "bench", split, tokens, shard_tokens)
        counts[split] = int(tokens.size)
    summary = {"documents": len(docs), "val_documents": n_val, "train_tokens": counts["train"],
               "val_tokens": counts["val"], "source": str(text_dir) if text_dir else " ".join(DEBIAN_PACKAGES)}
    summary_path.write_text(json.dumps(summary, indent=2))
    return summary


def remap_vocabulary(corpus: Path, vocab: int) -> Path:
    """The corpus over a smaller vocabulary: the vocab-1 most frequent training tokens keep their own ids (by
    rank), every other token becomes one id, vocab-1. On a CPU, GPT-2's 50,257-way head would cost most of a
    small model's compute and hold most of its parameters (AdamW's, not Muon's); this keeps the comparison about
    the transformer blocks, where the optimizers differ. Written once, beside the corpus."""
    import numpy as np

    from shared.data import find_shards, read_shard, write_shard

    out = corpus.parent / f"{corpus.name}-vocab{vocab}"  # beside it: shards are found recursively
    train, val = find_shards(str(corpus), "train"), find_shards(str(corpus), "val")
    if out.is_dir() and len(find_shards(str(out), "train")) == len(train):
        return out
    counts = sum(np.bincount(read_shard(path), minlength=2**16) for path in train)
    table = np.full(2**16, vocab - 1, dtype=np.uint16)
    table[np.argsort(-counts, kind="stable")[:vocab - 1]] = np.arange(vocab - 1, dtype=np.uint16)
    out.mkdir(parents=True, exist_ok=True)
    for path in train + val:
        write_shard(out / path.name, table[read_shard(path)])
    return out


def run(name: str, cfg, out_root: Path) -> list[tuple[int, float]]:
    """Train cfg (fresh, in out_root/name) and return its (tokens, val_loss) curve."""
    from shared.train.metrics import read_metrics
    from shared.train.trainer import train

    out = out_root / name
    metrics = out / "metrics.jsonl"
    if not (metrics.exists() and any(r.get("event") == "session_end" and r["step"] == cfg.lr_schedule.total_steps
                                     for r in read_metrics(metrics))):
        shutil.rmtree(out, ignore_errors=True)
        result = train(cfg.replace(out_dir=str(out)), log=lambda *a, **k: None)
        if result.stop_reason == "SIGTERM":  # the trainer ends a run cleanly on SIGTERM; the bench stops with it
            raise SystemExit(f"stopped (SIGTERM) during {name}; run again to go on from the finished runs")
    return [(r["tokens"], r["val_loss"]) for r in read_metrics(metrics) if "val_loss" in r]


def tokens_to_reach(target: float, finals: list[tuple[int, float]]) -> tuple[float | None, bool]:
    """The token budget whose final loss is `target`, interpolated linearly in log(tokens) between the two
    budgets around it, and whether that is an estimate (True) or only an upper bound (False: the smallest
    budget tried already reaches it). (None, False) if even the largest budget does not."""
    import math

    finals = sorted(finals)
    if finals[0][1] <= target:
        return float(finals[0][0]), False
    for (t0, l0), (t1, l1) in zip(finals, finals[1:], strict=False):
        if l1 <= target < l0:
            return math.exp(math.log(t0) + (l0 - target) / (l0 - l1) * (math.log(t1) - math.log(t0))), True
    return None, False


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float, float, float]]:
    """(tokens, mean, min, max) over seeds at each eval (every seed's run evaluates at the same tokens)."""
    import numpy as np

    losses = np.array([[loss for _, loss in curve] for curve in curves])
    return [(t, float(m), float(lo), float(hi))
            for (t, _), m, lo, hi in zip(curves[0], losses.mean(0), losses.min(0), losses.max(0), strict=True)]


def plot_curves(curves: dict[str, list[list[tuple[int, float]]]], target: float, path: Path, title: str,
                target_label: str = "the best control's final") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5), dpi=100)
    for name, runs in curves.items():  # the control dashed, Muon solid; the band is the seeds' min to max
        points = mean_curve(runs)[1:]
        tokens = [t / 1e6 for t, *_ in points]
        line, = ax.plot(tokens, [m for _, m, _, _ in points], marker=".", label=name,
                        linestyle="--" if name.lower().startswith("adamw") else "-")
        ax.fill_between(tokens, [lo for *_, lo, _ in points], [hi for *_, hi in points], alpha=0.2,
                        color=line.get_color())
    ax.axhline(target, color="gray", linestyle=":", linewidth=1,
               label=f"{target_label}, mean {target:.3f}")
    ax.set(xlabel="training tokens (millions)", ylabel="validation loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def spread(values: list[float]) -> str:
    import statistics

    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f} ({min(values):.4f}–{max(values):.4f})"


def record_settings(adamw_lr: float) -> dict:
    """The 2024-10-10 Muon record's optimizer settings (the recipe's, docs/recipe.md section 1) at this AdamW LR: every
    matrix moving by 0.1 x the AdamW LR RMS per element, momentum 0.95, no Muon decay, no clip, no warm-up, a linear
    decay over the last 0.29."""
    return {"optimizer": "muon", "muon_scale": "max_dim", "muon_lr": 0.1 * adamw_lr, "muon_momentum": 0.95,
            "muon_momentum_warmup_steps": 0, "muon_weight_decay": 0.0, "grad_clip": 0.0, "warmup_steps": 0,
            "cooldown_frac": 0.29, "cooldown_shape": "linear"}


def compared_settings(adamw_lr: float, n_embd: int, steps: int) -> dict[str, dict]:
    """--compare's runs, keyed by the folder name each run's output takes: the record's settings, its Muon LR halved,
    doubled and x4 (the sweep around it), and the recipe before issue 32 at the same ratios as at gpt2's width (its
    0.02 in the Muon README's convention moves 768-wide square matrices 2x the record's step: here 2x too; clip 1.0;
    100 and 300 of 13,352 steps of LR and momentum warm-up; Muon decay 0.01; a 0.4 decay)."""
    record = record_settings(adamw_lr)
    previous = {**record, "muon_scale": "shape", "muon_lr": 2 * record["muon_lr"] * n_embd ** 0.5,
                "muon_momentum_warmup_steps": max(1, round(steps * 300 / 13352)), "muon_weight_decay": 0.01,
                "grad_clip": 1.0, "warmup_steps": max(1, round(steps * 100 / 13352)), "cooldown_frac": 0.4}
    return {"record": record, "record-lr-half": {**record, "muon_lr": record["muon_lr"] / 2},
            "record-lr-double": {**record, "muon_lr": record["muon_lr"] * 2},
            "record-lr-x4": {**record, "muon_lr": record["muon_lr"] * 4}, "before-issue-32": previous}


def compare(base, args, steps: int, out_root: Path) -> str:
    """Every setting of compared_settings on the same seeds (paired): final val loss per run, each one's difference
    from the record's seed by seed, and the record runs' decay gain (docs/recipe.md section 5)."""
    from shared.runtime.optim import stable_phase_end

    settings = compared_settings(args.adamw_lr, args.n_embd, steps)
    finals: dict[str, list[float]] = {name: [] for name in settings}
    gains = []
    for index in range(args.seeds):
        seed = base.model.seed + index
        for name, changes in settings.items():
            cfg = base.replace(seed=seed, total_steps=steps, **changes)
            curve = run(f"compare-{name}-seed{seed}", cfg, out_root)
            finals[name].append(curve[-1][1])
            if name == "record":  # its loss where the stable phase ends (an eval's key step) and at the end
                stable = dict(curve)[stable_phase_end(cfg) * cfg.step.total_batch_tokens]
                gains.append((stable - curve[-1][1]) / stable / cfg.lr_schedule.cooldown_frac)
    record = finals["record"]
    lines = [f"| settings | final val loss: mean ± sd (min–max), {args.seeds} seeds | minus the record's, per seed |",
             "| --- | --- | --- |"]
    for name, values in finals.items():
        diffs = [v - r for v, r in zip(values, record, strict=True)]
        lines.append(f"| {name} | {spread(values)} | "
                     + ("—" if name == "record" else ", ".join(f"{d:+.4f}" for d in diffs)) + " |")
    lines.append("")
    lines.append(f"The record's decay: the val loss at the stable phase's end fell by {min(gains):.3f}–"
                 f"{max(gains):.3f} of itself per unit of cooldown_frac (per seed: "
                 + ", ".join(f"{g:.3f}" for g in gains) + "); published Muon runs: 0.137–0.172")
    return "\n".join(lines)


def add_bench_args(parser: argparse.ArgumentParser, **defaults) -> None:
    """The flags both recipe benches take, with each bench's own defaults (out_dir, vocab, seq_len, batch_tokens,
    micro_batch, evals, eval_batches): where the corpus and the runs go, the model's size, the batch, the evals."""
    parser.add_argument("--out-dir", default=defaults["out_dir"])
    parser.add_argument("--corpus-dir", default="data/bench-corpus")
    parser.add_argument("--text-dir", default=None, help="documents to use instead of Debian's documentation")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=defaults["vocab"],
                        help="the most frequent tokens kept (0: GPT-2's all)")
    parser.add_argument("--seq-len", type=int, default=defaults["seq_len"])
    parser.add_argument("--batch-tokens", type=int, default=defaults["batch_tokens"], help="tokens per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=defaults["micro_batch"])
    parser.add_argument("--evals", type=int, default=defaults["evals"], help="validation evals per (full-budget) run")
    parser.add_argument("--eval-batches", type=int, default=defaults["eval_batches"],
                        help="micro-batches per validation eval")


def prepare_bench(args: argparse.Namespace) -> tuple[dict, Path]:
    """The corpus (built once) and the folder its runs read (over --vocab's remapped vocabulary where set); and the
    bench's model size as the preset "bench", of this process only (the trainer takes its model by preset)."""
    from shared.model_shape import MODEL_PRESETS, PADDED_VOCAB_SIZE, ModelConfig

    corpus = build_corpus(Path(args.corpus_dir), Path(args.text_dir) if args.text_dir else None)
    data_dir = remap_vocabulary(Path(args.corpus_dir), args.vocab) if args.vocab else Path(args.corpus_dir)
    MODEL_PRESETS["bench"] = ModelConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                                         block_size=args.seq_len, vocab_size=args.vocab or PADDED_VOCAB_SIZE)
    return corpus, data_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser, out_dir="runs/bench-recipe", vocab=4096, seq_len=256, batch_tokens=16384, micro_batch=32,
                   evals=4, eval_batches=20)
    parser.add_argument("--tokens", type=float, default=1.0e6, help="the token budget of the control")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per setting (each pairs the two arms)")
    parser.add_argument("--adamw-lr", type=float, default=4e-3,
                        help="both arms: AdamW's LR for the embeddings, biases and gains")
    parser.add_argument("--matrix-lrs", default="2.5e-4,5e-4,1e-3,2e-3",
                        help="the control: AdamW's LRs for the blocks' matrices, one control per value; the best "
                             "(lowest mean final loss) is the target (around the best uniform AdamW LR of the earlier "
                             "sweep in docs/recipe.md section 4, so the best lies inside the sweep)")
    parser.add_argument("--muon-lr", type=float, default=0.02)
    parser.add_argument("--muon-fractions", default="1,0.5,0.25", help="Muon's budgets, as fractions of --tokens")
    parser.add_argument("--compare", action="store_true",
                        help="Muon's settings side by side instead of Muon against AdamW: the 2024-10-10 record's "
                             "(the recipe's), its Muon LR x0.5, x2 and x4, and the recipe before issue 32, on "
                             "paired seeds (compared_settings)")
    args = parser.parse_args()

    from shared.config import TrainConfig

    corpus, data_dir = prepare_bench(args)
    print(f"corpus: {corpus['train_tokens']:,} train / {corpus['val_tokens']:,} validation tokens, "
          f"{corpus['documents']:,} documents ({corpus['source']})")
    steps = int(args.tokens // args.batch_tokens)
    if steps * args.batch_tokens > corpus["train_tokens"]:
        raise UserError(f"--tokens {args.tokens:.3g} is more than one pass over the corpus "
                        f"({corpus['train_tokens']:,} tokens): the runs would see text twice")
    val_batches = corpus["val_tokens"] // (args.micro_batch * (args.seq_len + 1))
    if args.eval_batches > val_batches:
        raise UserError(f"--eval-batches {args.eval_batches}: the validation split holds {val_batches} batches of "
                        f"{args.micro_batch} x {args.seq_len}; use a smaller --micro-batch or fewer batches")
    eval_every = max(1, steps // args.evals)
    base = TrainConfig.from_dict(dict(
        preset="bench", micro_batch=args.micro_batch, total_batch_tokens=args.batch_tokens,
        data_dir=str(data_dir), backend=args.backend, bf16=args.backend != "cpu",
        eval_batches=args.eval_batches, eval_every=eval_every, warmup_steps=max(1, steps // 20),
        checkpoint_every=0, keep_checkpoints=1, keep_stable=False, progress=True, wandb_project="",
        xla_cache=False, time_budget=1e9, log_every=10, schedule="wsd", lr=args.adamw_lr))
    out_root = Path(args.out_dir)
    if args.compare:
        report = compare(base, args, steps, out_root)
        (out_root / "compare.md").write_text(report + "\n")
        print(report)
        return
    matrix_lrs = [float(lr) for lr in args.matrix_lrs.split(",")]
    control_names = {lr: f"AdamW + wsd (matrices {lr:g}, the rest {args.adamw_lr:g})" for lr in matrix_lrs}
    curves: dict[str, list] = {name: [] for name in control_names.values()}
    muon_finals: list[list[tuple[int, float]]] = []
    for index in range(args.seeds):
        seed = base.model.seed + index
        for lr, name in control_names.items():
            control = base.replace(seed=seed, total_steps=steps, matrix_lr=lr)
            curves[name].append(run(f"control-{lr:g}-seed{seed}", control, out_root))
        finals = []
        for fraction in [float(f) for f in args.muon_fractions.split(",")]:
            # A shorter run ends on an eval (every eval_every steps): its final loss is its end's.
            muon_steps = steps if fraction >= 1 else max(eval_every, int(steps * fraction) // eval_every * eval_every)
            muon = base.replace(seed=seed, total_steps=muon_steps, optimizer="muon", muon_lr=args.muon_lr)
            curve = run(f"muon-{fraction:g}-seed{seed}", muon, out_root)
            curves.setdefault(f"Muon + wsd (lr {args.muon_lr:g}), {muon_steps / steps:.2f}x budget", []).append(curve)
            finals.append((curve[-1][0], curve[-1][1]))
        muon_finals.append(finals)
    control_name = min(control_names.values(), key=lambda name: sum(c[-1][1] for c in curves[name]))
    control_finals = [curve[-1][1] for curve in curves[control_name]]
    target_tokens = curves[control_name][0][-1][0]
    muon_full = [sorted(finals)[-1][1] for finals in muon_finals]  # each seed's full-budget run
    png = plot_curves(curves, sum(control_finals) / len(control_finals), out_root / "val_loss.png",
                      f"GPT-2 {args.n_layer}L/{args.n_embd}d, vocabulary {args.vocab or 'GPT-2'}"
                      f"{' (remapped)' if args.vocab else ''}, {args.seeds} seeds, band: min to max")
    lines = [f"| run | tokens | final val loss: mean ± sd (min–max) over {args.seeds} seeds |", "| --- | --- | --- |"]
    lines += [f"| {name} | {runs[0][-1][0]:,} | {spread([c[-1][1] for c in runs])} |" for name, runs in curves.items()]
    lines.append("")
    if max(muon_full) < min(control_finals):
        ratios = []
        for control_final, finals in zip(control_finals, muon_finals, strict=True):
            needed, interpolated = tokens_to_reach(control_final, finals)
            ratios.append((target_tokens / needed, interpolated) if needed else (None, False))
        known = [r for r, _ in ratios if r]
        bound = "" if all(i for _, i in ratios) else (" (where a seed's smallest budget already reached it, that "
                                                      "budget counts: a lower bound)")
        lines.append(f"Muon + wsd reaches the best control's ({control_name}) final val loss in "
                     f"{target_tokens / max(known):,.0f} to "
                     f"{target_tokens / min(known):,.0f} tokens against the control's {target_tokens:,}: "
                     f"{min(known):.2f}x to {max(known):.2f}x fewer (mean {sum(known) / len(known):.2f}x; per seed "
                     + ", ".join(f"{r:.2f}x" if r else "not reached" for r, _ in ratios) + f"){bound}")
    else:
        lines.append(f"Muon's full-budget final losses ({spread(muon_full)}) and the best control's "
                     f"({spread(control_finals)}) overlap across seeds: no token ratio is claimed")
    report = "\n".join(lines)
    (out_root / "report.md").write_text(report + f"\n\n![validation loss]({png.name})\n")
    print(report)
    print(f"plot: {png}")


if __name__ == "__main__":
    run_cli(main)
