"""The run report: `report.md` and three PNGs (loss, HellaSwag, throughput against tokens), drawn from the
metrics JSONL alone, so any checkpoint (which carries the run's metrics.jsonl) can be reported from.

Every file is written to a temporary name and renamed, so a report once written is never left half-written.
"""

from __future__ import annotations

import os
from pathlib import Path

from shared.config import HELLASWAG_VALIDATION_EXAMPLES
from shared.train.metrics import GPT2_124M_VAL_LOSS, plot_loss, read_metrics
from shared.train.reference import REFERENCE_SOURCE, published_curve
from shared.train.reference import summary_line as reference_summary
from shared.train.throughput import plot_points, run_throughput, session_throughput, split_sessions

# Reference numbers (build-nanogpt): HellaSwag acc_norm (10,042); the validation loss's is GPT2_124M_VAL_LOSS.
HELLASWAG_REFERENCES = {"GPT-2 124M": 0.2945, "GPT-3 124M": 0.337, "GPT-2 350M": 0.3752}
HELLASWAG_CHANCE = 0.25
FIGSIZE, DPI = (8, 4.5), 100  # every PNG is 800 x 450 pixels
REPORT_FILE = "report.md"
LOSS_PNG, HELLASWAG_PNG, THROUGHPUT_PNG = "loss.png", "hellaswag.png", "throughput.png"


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _session_lines(ax, records: list[dict]) -> None:
    first = True
    for r in records:
        if r.get("event") == "session_start" and r.get("step", 0) > 0:
            ax.axvline(r["tokens"], color="grey", ls=":", lw=0.8, label="new session" if first else None)
            first = False


def _save(fig, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=DPI)
    _pyplot().close(fig)
    os.replace(tmp, path)
    return path


def plot_hellaswag(records: list[dict], path: Path) -> Path:
    plt = _pyplot()
    points = [r for r in records if r.get("hellaswag_acc_norm") is not None]
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    during = [r for r in points if r.get("event") != "eval"]
    final = [r for r in points if r.get("event") == "eval"]
    if during:
        ax.plot([r["tokens"] for r in during], [r["hellaswag_acc_norm"] for r in during], "o-", ms=3,
                label=f"acc_norm during training ({during[-1].get('hellaswag_examples', '?')} examples)")
    if final:
        ax.plot([r["tokens"] for r in final], [r["hellaswag_acc_norm"] for r in final], "*", ms=12,
                label=f"acc_norm, eval kernel ({final[-1].get('hellaswag_examples', '?')} examples)")
    for (name, value), color in zip(HELLASWAG_REFERENCES.items(), ("red", "purple", "green"), strict=False):
        ax.axhline(value, color=color, ls="--", lw=1, label=f"{name}: {value}")
    ax.axhline(HELLASWAG_CHANCE, color="black", ls=":", lw=0.8, label="chance: 0.25")
    _session_lines(ax, records)
    ax.set_xlabel("tokens")
    ax.set_ylabel("HellaSwag acc_norm")
    ax.set_title("HellaSwag" + ("" if points else " (no evaluation yet)"))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    return _save(fig, path)


def plot_throughput(records: list[dict], path: Path) -> Path:
    """Each session's tokens/s against tokens, over trailing spans of its log windows (shared/train/throughput.py
    `plot_points`: a single window's rate is no measure under XLA), with its whole-session rate dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    drawn = 0
    for number, session in enumerate(split_sessions(records), start=1):
        points, whole = plot_points(session), session_throughput(session)
        if not points or whole is None:
            continue
        drawn += 1
        line, = ax.plot([x for x, _ in points], [y for _, y in points], lw=1.2, marker="." if len(points) < 30 else "",
                        label=f"session {number}: {whole.tokens_per_s:,.0f} tokens/s")
        ax.hlines(whole.tokens_per_s, points[0][0], points[-1][0], colors=line.get_color(), linestyles="--", lw=0.8)
    ax.set_ylim(bottom=0)
    _session_lines(ax, records)
    ax.set_xlabel("tokens")
    ax.set_ylabel("tokens / s")
    ax.set_title("Training throughput")
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)


def plot_losses(metrics_path: Path, path: Path) -> Path:
    tmp = path.with_name(f".{path.stem}.tmp.png")
    plot_loss(metrics_path, tmp, reference=GPT2_124M_VAL_LOSS,
              reference_label=f"OpenAI GPT-2 124M val loss: {GPT2_124M_VAL_LOSS}",
              published=published_curve(read_metrics(metrics_path)))
    os.replace(tmp, path)
    return path


def last_with(records: list[dict], key: str) -> dict | None:
    """The last record holding `key`, preferring the eval kernel's ("event": "eval") over in-training ones."""
    found = [r for r in records if r.get(key) is not None]
    final = [r for r in found if r.get("event") == "eval"]
    return (final or found or [None])[-1]


def _fmt(value, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _billions(tokens) -> str:
    return "—" if tokens is None else f"{tokens / 1e9:.3f}B" if tokens >= 1e8 else f"{tokens:,}"


def summary_table(records: list[dict]) -> list[str]:
    val, hs = last_with(records, "val_loss"), last_with(records, "hellaswag_acc_norm")
    lines = ["| | this model | OpenAI GPT-2 124M | GPT-3 124M | GPT-2 350M |", "|---|---|---|---|---|"]
    val_at = f" (step {val['step']})" if val else ""
    lines.append(f"| validation loss{val_at} | {_fmt(val and val['val_loss'])} | {GPT2_124M_VAL_LOSS} | | |")
    if hs:
        ref = HELLASWAG_REFERENCES
        lines.append(f"| HellaSwag acc_norm (step {hs['step']}, {hs.get('hellaswag_examples', '?')} examples) | "
                     f"{_fmt(hs['hellaswag_acc_norm'])} | {ref['GPT-2 124M']} | {ref['GPT-3 124M']} | "
                     f"{ref['GPT-2 350M']} |")
        lines.append(f"| HellaSwag acc | {_fmt(hs.get('hellaswag_acc'))} | | | |")
    else:
        lines.append("| HellaSwag acc_norm | — | 0.2945 | 0.337 | 0.3752 |")
    verdict = []
    if val:
        gap = val["val_loss"] - GPT2_124M_VAL_LOSS
        verdict.append(f"validation loss {'reaches' if gap <= 0 else 'is above'} GPT-2 124M's by {abs(gap):.4f}")
    if hs:
        gap = hs["hellaswag_acc_norm"] - HELLASWAG_REFERENCES["GPT-2 124M"]
        partial = hs.get("hellaswag_examples", 0) < HELLASWAG_VALIDATION_EXAMPLES
        verdict.append(f"HellaSwag acc_norm {'reaches' if gap >= 0 else 'is below'} GPT-2 124M's by {abs(gap):.4f}"
                       + (" (on a subset)" if partial else ""))
    return lines + ([""] + ["**Verdict:** " + "; ".join(verdict) + "."] if verdict else [])


def reference_section(records: list[dict]) -> list[str]:
    """The run held against a published run's curve (shared/train/reference.py): its early verdict and its newest
    standing ([] where it never was)."""
    held = [r for r in records if r.get("event") == "reference"]
    if not held:
        return []
    first = next((r for r in held if r.get("reference_verdict")), None)
    lines = ["## Against a published run", "", f"- reference: {REFERENCE_SOURCE}"]
    if first:
        lines.append(f"- early verdict (step {first['step']}): {first['reference_verdict']}: "
                     f"{first.get('reference_reason', '')}")
    return lines + [f"- newest (step {held[-1]['step']}): {reference_summary(held[-1])}", ""]


def write_report(out_dir: str | os.PathLike, metrics_path: str | os.PathLike, info: dict | None = None,
                 samples: list[dict] | None = None, notes: list[str] | None = None) -> Path:
    """report.md, loss.png, hellaswag.png, throughput.png in `out_dir` from a metrics JSONL file.

    info: lines about the model and data ({"checkpoint": ..., "validation data": ...}); samples: dicts with
    "prompt" and "text"; notes: warnings and errors of this evaluation, listed in the report.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = Path(metrics_path)
    records = read_metrics(metrics_path)
    plot_losses(metrics_path, out / LOSS_PNG)
    plot_hellaswag(records, out / HELLASWAG_PNG)
    plot_throughput(records, out / THROUGHPUT_PNG)

    train = [r for r in records if r.get("loss") is not None]
    starts = [r for r in records if r.get("event") == "session_start"]
    lines = ["# GPT-2 evaluation report", "", "## Did it reach GPT-2?", "", *summary_table(records), "",
             "References: build-nanogpt's FineWeb-Edu validation shard (the loss is only comparable on that data) "
             "and HellaSwag acc_norm over its 10,042 validation examples, scored as build-nanogpt does: the "
             "log-likelihood of each ending divided by its number of tokens (lm-eval-harness divides by characters "
             "and reports 0.3114 for GPT-2 124M).", ""]
    if info:
        lines += ["## Model and data", ""] + [f"- {k}: {v}" for k, v in info.items()] + [""]
    lines += ["## Training", ""]
    if train:
        last = train[-1]
        measured = run_throughput(records)
        rate = (f"{measured.describe()} ({measured.steps} steps in {measured.seconds:,.1f} s, each session's first "
                "log window left out)" if measured else "—")
        by_session = [(n, session_throughput(s)) for n, s in enumerate(split_sessions(records), start=1)]
        if sum(1 for _, found in by_session if found) > 1:
            rate += "; by session: " + ", ".join(f"{n}: {found.tokens_per_s:,.0f}" for n, found in by_session if found)
        lines += [f"- sessions: {max(1, len(starts))}", f"- steps: {last['step']}, tokens: {_billions(last['tokens'])}",
                  f"- last training loss: {_fmt(last['loss'])}", f"- throughput: {rate}", ""]
    else:
        lines += ["No training steps in the metrics history.", ""]
    lines += reference_section(records)
    lines += [f"![loss]({LOSS_PNG})", "", f"![HellaSwag]({HELLASWAG_PNG})", "", f"![throughput]({THROUGHPUT_PNG})", ""]
    if samples:
        lines += ["## Samples", ""]
        for s in samples:
            lines += ["```text", (s["prompt"] + s["text"]).replace("```", "` ` `"), "```", ""]
    if notes:
        lines += ["## Warnings and errors", ""] + [f"- {n}" for n in notes] + [""]
    report = out / REPORT_FILE
    _atomic_text(report, "\n".join(lines))
    return report
