"""Run logging: a JSONL metrics file (the record of truth), a progress bar, optional W&B, a loss plot.

W&B is used only when a key is present (WANDB_API_KEY, or the Kaggle secret of that name); any failure there
is a one-line notice, never a crash, and the key itself is never printed.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse


def read_metrics(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_session_records(path: str | os.PathLike) -> list[dict]:
    """The records of the last session in a metrics.jsonl, from its `session_start` on (a resumed run's file
    starts with the earlier sessions' records, the checkpoint's copy); [] where it has none."""
    records = read_metrics(path)
    starts = [i for i, r in enumerate(records) if r.get("event") == "session_start"]
    return records[starts[-1]:] if starts else []


def wandb_run_id(text: str) -> str:
    """A W&B run id (letters, digits, dashes, underscores) from a run id or name."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", text).strip("-") or "run"


class MetricsLogger:
    def __init__(self, out_dir: str | os.PathLike, total_steps: int, start_step: int, config: dict,
                 wandb_project: str = "", run_name: str = "", progress: bool = True, log=print,
                 enabled: bool = True, run_id: str = "", wandb_key: str | None = None):
        """`enabled=False` (the non-main processes of a DDP run) makes every method a no-op. W&B logs with
        `wandb_project` and `wandb_key` (the caller's: shared.kaggle.secrets.wandb_key), never showing the key."""
        self.path = Path(out_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.log = log
        self._bar = self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             mininterval=2.0)
        run_name = run_name or Path(out_dir).name
        self._wandb = self._start_wandb(wandb_project, wandb_key, run_name, wandb_run_id(run_id or run_name), config)

    def _start_wandb(self, project: str, key: str | None, run_name: str, run_id: str, config: dict):
        if not project:
            return None
        if not key:
            self.log("notice: no W&B key found (WANDB_API_KEY); logging to metrics.jsonl only")
            return None
        from shared.kaggle.packages import provide

        problem = provide("wandb", "W&B logging", self.log)  # Kaggle's TPU image has no wandb: installed if it can be
        if problem:
            self.log(f"notice: W&B off: {problem}; logging to metrics.jsonl only")
            return None
        host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
        try:  # a Kaggle session without internet fails here in seconds, not in wandb's minutes of retries
            socket.create_connection((host.hostname, host.port or 443), timeout=5).close()
        except OSError:
            self.log(f"notice: W&B unreachable ({host.hostname}; no internet?); logging to metrics.jsonl only")
            return None
        try:
            import wandb

            wandb.login(key=key, verify=False)
            # One W&B run per training run, resumed across sessions by its id.
            return wandb.init(project=project, name=run_name, id=run_id, resume="allow",
                              config=config, dir=str(self.path.parent), settings=wandb.Settings(init_timeout=60))
        except Exception as err:  # network down, bad key, package missing: keep training
            self.log(f"notice: W&B unavailable ({type(err).__name__}); logging to metrics.jsonl only")
            return None

    def write(self, record: dict) -> None:
        """Append one record (`step` plus metrics) to the JSONL file, the bar and W&B."""
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self._bar is not None and "loss" in record:
            self._bar.n = record["step"]
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):,.0f}",
                                  refresh=False)
            self._bar.refresh()
        if self._wandb is not None:
            try:
                self._wandb.log({k: v for k, v in clean.items() if k != "step" and v is not None},
                                step=record["step"])
            except Exception as err:
                self.log(f"notice: W&B logging failed ({type(err).__name__}); continuing without it")
                self._wandb = None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception:
                pass


class BackgroundCalls:
    """Runs submitted calls one at a time, in order, on a thread of their own, so that a logging call that reads
    device values (and so waits for the device to finish the step) does not hold up the training loop: the host
    goes on tracing the next step. `threaded=False` runs each call at once, in the caller (DDP: the logging call
    takes part in a collective, which every process must enter from its main thread).

    `flush()` waits for every call submitted so far and re-raises the first error one of them raised."""

    def __init__(self, threaded: bool = True):
        self._queue: queue.Queue | None = queue.Queue() if threaded else None
        self._error: BaseException | None = None
        if self._queue is not None:
            threading.Thread(target=self._work, name="metrics-writer", daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, args = self._queue.get()
            try:
                if self._error is None:  # after a failure the rest are dropped; flush() reports the failure
                    fn(*args)
            except BaseException as err:  # re-raised in the training loop's thread by flush()
                self._error = err
            finally:
                self._queue.task_done()

    def submit(self, fn: Callable, *args) -> None:
        if self._queue is None:
            fn(*args)
        else:
            self._queue.put((fn, args))

    def flush(self) -> None:
        if self._queue is not None:
            self._queue.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def drain(self) -> None:
        """Waits for the calls submitted so far, raising nothing: for a session ending on an error, whose process
        must not exit while this thread is still inside a device read (torch_xla aborts the process then)."""
        if self._queue is not None:
            self._queue.join()


GPT2_HELLASWAG = 0.2945  # OpenAI GPT-2 124M's HellaSwag acc_norm (the project's target)
GPT2_124M_VAL_LOSS = 3.2924  # OpenAI GPT-2 124M's loss on FineWeb-Edu's validation shard (build-nanogpt)


def plot_series(records: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """What the training plot draws, as (tokens, value) points: train loss, validation loss and, where the run
    scored HellaSwag at its evals, acc_norm."""
    def points(key: str) -> list[tuple[float, float]]:
        return [(r["tokens"], r[key]) for r in records if r.get(key) is not None and r.get("event") != "eval"]

    return {"train loss": points("loss"), "val loss": points("val_loss"), "hellaswag": points("hellaswag_acc_norm")}


def plot_loss(metrics_path: str | os.PathLike, png_path: str | os.PathLike, reference: float | None = None,
              reference_label: str = "", published: tuple | None = None) -> Path:
    """Train (and validation, where logged) loss against tokens seen, one line per session boundary; HellaSwag
    acc_norm on a second axis where the evals scored it, against GPT-2 124M's. `published`: a published run's
    (tokens, val loss, HellaSwag, name) drawn beside the run's (shared/train/reference.py published_curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    series = plot_series(records)
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for name, style in (("train loss", "-"), ("val loss", "o-")):
        if series[name]:
            xs, ys = zip(*series[name], strict=True)
            ax.plot(xs, ys, style, label=name, lw=1.2, ms=3)
    for r in records:
        if r.get("event") == "session_start" and r.get("step", 0) > 0:
            ax.axvline(r["tokens"], color="grey", ls=":", lw=0.8)
    if reference is not None:
        ax.axhline(reference, color="red", ls="--", lw=1, label=reference_label or f"reference {reference}")
    curve = published
    if curve:
        ax.plot(curve[0], curve[1], "--", color="grey", lw=1, label=f"{curve[3]}: val loss")
    handles, labels = ax.get_legend_handles_labels()
    if series["hellaswag"]:
        hs = ax.twinx()
        xs, ys = zip(*series["hellaswag"], strict=True)
        hs.plot(xs, ys, "s--", color="tab:green", ms=3, lw=1, label="HellaSwag acc_norm")
        if curve:
            hs.plot(curve[0], curve[2], ":", color="darkgreen", lw=1, label=f"{curve[3]}: HellaSwag (5-eval mean)")
        hs.axhline(GPT2_HELLASWAG, color="tab:green", ls=":", lw=0.8, label=f"GPT-2 124M {GPT2_HELLASWAG}")
        hs.set_ylabel("HellaSwag acc_norm")
        more = hs.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.set_title("GPT-2 training loss")
    ax.grid(alpha=0.3)
    if handles:
        ax.legend(handles, labels)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
