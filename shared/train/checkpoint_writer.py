"""A session's checkpoint writes: when (`Checkpointer`: every `checkpoint_every` steps, where a wsd run's stable
phase ends, at the session's end), what a checkpoint holds (`CheckpointWriter`: the tensors gathered to the host, the
loader's position, RNG, config, timings, the XLA compile cache) and how long a write takes (`CheckpointTimer`, which
sizes the time budget's margin); and `restore_compile_cache`, the compile cache a resumed checkpoint carried. The
on-disk format (written whole or not at all, verified, rotated) is shared/train/checkpoint.py's."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

from shared.checkpoint_names import STABLE_DIR
from shared.config import TrainConfig
from shared.data import TokenLoader
from shared.model.model import GPT
from shared.runtime.optim import optimizer_tensors, stable_phase_end
from shared.runtime.runtime import Runtime
from shared.runtime.step import TrainStep
from shared.train.checkpoint import METRICS_FILE, LoadedCheckpoint, checkpoint_name, save_checkpoint
from shared.train.metrics import BackgroundCalls, MetricsLogger

XLA_CACHE_DIR = "xla_cache"  # inside out_dir, and inside each checkpoint (XLA's persistent compilation cache)


def restore_compile_cache(resumed, out_dir: Path) -> Path:
    """`<out_dir>/xla_cache`, seeded with the compiled graphs that travelled in the resumed checkpoint."""
    cache = out_dir / XLA_CACHE_DIR
    cache.mkdir(parents=True, exist_ok=True)
    saved = resumed.path / XLA_CACHE_DIR if resumed else None
    if saved and saved.is_dir():
        for file in saved.iterdir():
            if file.is_file() and not (cache / file.name).exists():
                shutil.copyfile(file, cache / file.name)
    return cache


class CheckpointTimer:
    """Measures checkpoint writes, so the time budget can keep a margin sized from real numbers."""

    def __init__(self, estimate: float):
        self.seconds = estimate

    def time(self, fn, *args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        self.seconds = time.perf_counter() - start
        return result


# Called after each checkpoint of the rotation with (step, path); None: nothing.
OnSave = Callable[[int, Path], None] | None


class Checkpointer:
    """Decides when to write a checkpoint and times each write: every `checkpoint_every` steps, where a wsd
    run's stable phase ends (apart, in <root>/stable/, out of rotation: --extend trains on from it), and at the
    session's end. `write(root, step, keep)` is the trainer's: it gathers the tensors and saves them."""

    def __init__(self, cfg: TrainConfig, root: Path, step: int, timer: CheckpointTimer,
                 write: Callable[[Path, int, int], Path], on_save: OnSave = None):
        """on_save(step, path): called after each checkpoint of the rotation (not the stable phase's, not the
        session's last), e.g. to publish one midway through a session (shared/kaggle/publish.py MidwayPublish)."""
        self.cfg, self.root, self.timer, self.write, self.on_save = cfg, root, timer, write, on_save
        self.stable_end = stable_phase_end(cfg) if cfg.session.keep_stable else None
        self.saved_step = step

    def maybe_save(self, step: int) -> None:
        every = self.cfg.session.checkpoint_every
        if every and step % every == 0 and step < self.cfg.lr_schedule.total_steps:
            path = self.write(self.root, step, self.cfg.session.keep_checkpoints)
            self.saved_step = step
            if self.on_save is not None:
                self.on_save(step, path)
        if step == self.stable_end:
            self.write(self.root / STABLE_DIR, step, 1)

    def seconds_after(self, step: int) -> float:
        """The writes still to come after `step` that the time budget must leave room for: the stable-phase one
        if the next step makes it, and the final one, with half again as margin."""
        stable = self.timer.seconds if step + 1 == self.stable_end else 0.0
        return stable + 1.5 * self.timer.seconds

    def final_save(self, step: int, start_step: int, resumed: LoadedCheckpoint | None) -> Path | None:
        """The session's last checkpoint: written unless this step's is already on disk."""
        if step != self.saved_step:
            return self.write(self.root, step, self.cfg.session.keep_checkpoints)
        if step > start_step:
            return self.root / checkpoint_name(step)
        return resumed.path if resumed else None  # nothing trained: the run was already complete


class CheckpointWriter:
    """Writes one checkpoint: the model's and optimizer's tensors gathered to the host (the checkpoint's
    device-to-host transfer, off the step path), the loader's position, RNG, config, timings and the XLA
    compile cache beside them, and logs it. Under DDP every process holds the same tensors; one writes them."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime, model: GPT, train_step: TrainStep, loader: TokenLoader,
                 timer: CheckpointTimer, compile_cache: Path | None, logger: MetricsLogger,
                 background: BackgroundCalls, ckpt_root: Path, session_start: float):
        self.cfg, self.runtime, self.model, self.train_step, self.loader = cfg, runtime, model, train_step, loader
        self.timer, self.compile_cache, self.logger, self.background = timer, compile_cache, logger, background
        self.ckpt_root, self.session_start = ckpt_root, session_start
        self.metrics_path = Path(cfg.session.out_dir) / METRICS_FILE

    def __call__(self, root: Path, step: int, keep: int) -> Path:
        self.background.flush()  # the logged steps before the checkpoint's record
        model_tensors = self.model.checkpoint_tensors()
        opt_tensors = optimizer_tensors(self.train_step.opt, self.train_step.named_params)
        tokens, scaler = step * self.cfg.step.total_batch_tokens, self.train_step.scaler
        path = root / checkpoint_name(step)
        if self.runtime.is_main:
            state = {"loader": self.loader.state.to_dict(), "rng": self.runtime.rng_state(), "config": {
                "train": self.cfg.to_dict(), "model": self.cfg.model.shape.to_dict()},
                "timings": {"checkpoint_seconds": self.timer.seconds}, "tokens": tokens,
                "grad_scaler": scaler.state_dict() if scaler.is_enabled() else None}
            extra = ({XLA_CACHE_DIR: self.compile_cache} if self.compile_cache and self.runtime.name == "xla"
                     else None)
            path = self.timer.time(save_checkpoint, root, step, model_tensors, opt_tensors, state,
                                   self.metrics_path, keep, extra)
        self.runtime.barrier()
        self.logger.write({"event": "checkpoint", "step": step, "tokens": tokens,
                           "checkpoint_s": round(self.timer.seconds, 3),
                           **({"stable": True} if root != self.ckpt_root else {}),
                           "elapsed_s": round(time.monotonic() - self.session_start, 3)})
        return path
