"""The training loop: one function, top to bottom, the same on TPU (XLA SPMD), XLA CPU devices and torch.

A session trains until total_steps, its time budget, SIGTERM, or --stop-after-steps, then writes a checkpoint;
the next session (a new process, maybe on another machine) resumes from it bit-exactly. `train` reads as set up,
resume, the loop, end; each part is a call with a name, here (setting up), in `shared.train.session` (the
session around the step: resume point, evals, metric lines) or in `shared.train.checkpoint_writer` (checkpoints).
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.config import TrainConfig
from shared.data import LoaderState, TokenLoader, find_shards
from shared.errors import UserError
from shared.model.attention import AttentionChoice
from shared.model.model import GPT
from shared.runtime.device import make_runtime
from shared.runtime.optim import stable_phase_end
from shared.runtime.runtime import Runtime, plan_versions_notice, runtime_versions
from shared.runtime.step import build_step, select_attention_and_micro_batch
from shared.runtime.xla_notices import runtime_notices
from shared.session_clock import SessionClock, default_time_budget, estimate_checkpoint_seconds
from shared.train.checkpoint import METRICS_FILE, LoadedCheckpoint
from shared.train.checkpoint_writer import (
    Checkpointer,
    CheckpointTimer,
    CheckpointWriter,
    OnSave,
    restore_compile_cache,
)
from shared.train.metrics import BackgroundCalls, MetricsLogger, plot_loss, read_metrics
from shared.train.reference import published_curve
from shared.train.session import Evaluator, StepLog, StepProfiler, log_projection, resume_point
from shared.train_sections import SessionSettings


@dataclass
class TrainResult:
    step: int
    last_loss: float | None
    checkpoint: Path | None
    stop_reason: str
    start_step: int = 0  # the step this session resumed from (--extend: maybe below the run's newest checkpoint)


def train(cfg: TrainConfig, runtime: Runtime | None = None, log=print, wandb_key: str | None = None,
          started: float | None = None, startup_parts: dict | None = None, on_checkpoint: OnSave = None,
          attention: AttentionChoice | None = None) -> TrainResult:
    """One session. `started`: its process's monotonic start (--session-deadline counts from it); `startup_parts`:
    seconds before it, by name; `on_checkpoint`: see Checkpointer; `attention`: a caller's choice (None: selected)."""
    session_start = time.monotonic()
    cfg.validate()  # the flags; the device count is checked once the runtime is up
    out_dir = Path(cfg.session.out_dir)
    ckpt_root = Path(cfg.session.checkpoint_dir) if cfg.session.checkpoint_dir else out_dir / "checkpoints"
    train_shards, val_shards = find_shards(cfg.data.data_dir, "train"), find_shards(cfg.data.data_dir, "val")
    if not train_shards:
        raise UserError(f"--data-dir {cfg.data.data_dir}: no *_train_*.bin token shards found")
    resumed = resume_point(cfg, ckpt_root, log)

    # XLA starts with the compiled graphs of the previous session when the checkpoint has them.
    compile_cache = restore_compile_cache(resumed, out_dir) if cfg.step.xla_cache else None
    runtime = runtime or make_runtime(cfg.step.backend, compile_cache)
    versions = runtime_versions()
    log_runtime_notices(runtime, versions, resumed, compile_cache, log)
    if not runtime.is_main:  # under DDP one process speaks for all
        log = lambda *args, **kwargs: None  # noqa: E731
    compiled_at_start = runtime.compile_seconds(), runtime.compile_count()
    cfg.validate(runtime.num_devices)
    cfg, attention = select_attention_and_micro_batch(cfg, runtime, log, attention)
    versions = runtime_versions()  # again: with the Mosaic version the kernel probes settled on
    loader, val_loader = make_loaders(cfg, train_shards, val_shards, resumed, log)
    model = make_model(cfg, runtime, resumed, attention)
    start_step = resumed.step if resumed else 0
    train_step = build_step(cfg, runtime, model, attention.kind, start_step, resumed.optimizer if resumed else None)
    restore_grad_scaler(train_step, resumed)
    ckpt_timer, clock = session_clock(cfg.session, resumed, model.num_params(), session_start, started, startup_parts)
    logger = start_logging(cfg, runtime, versions, model, resumed, clock, log, wandb_key)
    log(train_step.plan.describe(runtime, cfg.grad_accum_steps))

    stop_requested = threading.Event()
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    # Logging reads the device off the loop's thread, except with the scan over layers: torch_xla lowers the scan's
    # backward on autograd's device thread, and a device read on another thread meanwhile crashed the process
    # (segfault in scan.py's LoweringContext.build: 5 of 6 runs here; 0 of 3 with the reads in the loop's thread).
    background = BackgroundCalls(threaded=runtime.name == "xla" and not train_step.plan.scan_layers)
    write = CheckpointWriter(cfg, runtime, model, train_step, loader, ckpt_timer, compile_cache, logger, background,
                             ckpt_root, session_start)
    checkpointer = Checkpointer(cfg, ckpt_root, start_step, ckpt_timer, write, on_checkpoint)
    evaluator = Evaluator(model, runtime, cfg, val_loader, logger, background)
    step_log = StepLog(runtime, logger, background, start_step, cfg.step.total_batch_tokens,
                       cfg.model.shape.flops_per_token(), session_start, cfg.model.shape.flops_per_token_llmc())
    profiler = StepProfiler(cfg, runtime, start_step, log, lambda record: (background.flush(), logger.write(record)))

    # --- the loop ----------------------------------------------------------------------------------------------
    evaluator.baseline(start_step)
    step, stop_reason = start_step, "total_steps"
    loop_start = first_step_end = last_step_end = time.monotonic()
    # Summed: the host's CPU time building steps (data, tracing); the syncs' wall time (hash, launch, runtime waits).
    host_trace_s = sync_s = 0.0
    try:
        while step < cfg.lr_schedule.total_steps:
            step_started, compile_before = time.monotonic(), runtime.compile_seconds()
            cpu_started = time.thread_time()  # the host's own work: blocking waits (back-pressure) are not in it
            tokens = np.stack([loader.next_batch() for _ in range(cfg.grad_accum_steps)])  # (accum, B, T+1)
            loss, grad_norm, lr = train_step(tokens)
            step += 1
            host_trace_s += time.thread_time() - cpu_started
            if step % cfg.logging.log_every == 0 or step == cfg.lr_schedule.total_steps:
                runtime.add_step_closure(step_log.queue, (step, loss, grad_norm, lr, host_trace_s, sync_s))
            sync_started = time.monotonic()
            runtime.sync()  # launches the step; waits only for the previous step's graph to finish
            sync_s += time.monotonic() - sync_started
            # The next step costs what this one did, less any compilation (which does not recur).
            step_s = time.monotonic() - step_started - (runtime.compile_seconds() - compile_before)
            last_step_end = time.monotonic()
            if step == start_step + 1:
                first_step_end = last_step_end
                background.flush()  # step 1's line before the start-up record (and a too-short session's end)
                clock.first_step_done(step, loop_start, first_step_end, runtime.compile_seconds() - compile_before,
                                      ckpt_timer.seconds, logger.write, log)
            profiler.after(step)
            evaluator.maybe_run(step)
            checkpointer.maybe_save(step)
            # Under XLA the step just launched may still be running (the host runs a step ahead): count it too.
            in_flight = step_s if runtime.name == "xla" else 0.0
            stop_reason = ("SIGTERM" if stop_requested.is_set()
                           else "stop_after_steps" if 0 < cfg.session.stop_after_steps <= step - start_step
                           else "time_budget" if in_flight + step_s + checkpointer.seconds_after(step) > clock.left_s()
                           else "total_steps")
            if stop_reason != "total_steps":
                break
        background.flush()
        path = checkpointer.final_save(step, start_step, resumed)
        logger.write(session_end_record(cfg, runtime, clock, step, stop_reason, first_step_end, last_step_end,
                                        compiled_at_start))
    finally:
        profiler.close()
        signal.signal(signal.SIGTERM, previous_handler)
        background.drain()  # a session stopped by an error leaves no device read running as the process exits
        logger.close()
    metrics_path = out_dir / METRICS_FILE
    loss_png = session_plot(metrics_path, out_dir / "loss.png") if runtime.is_main else None
    log(f"session ended at step {step}/{cfg.lr_schedule.total_steps} ({stop_reason}); checkpoint {path}; "
        f"metrics {metrics_path}; plot {loss_png}; {runtime.compile_count()} XLA compilations")
    return TrainResult(step, step_log.last_loss, path, stop_reason, start_step)


# --- setting up a session ------------------------------------------------------------------------------------------

def session_plot(metrics_path: Path, png_path: Path) -> Path:
    """loss.png, with the published run the evals were held against drawn beside the run's (where they were)."""
    return plot_loss(metrics_path, png_path, published=published_curve(read_metrics(metrics_path)))


def log_runtime_notices(runtime: Runtime, versions: dict, resumed: LoadedCheckpoint | None, compile_cache: Path | None,
                        log) -> None:
    """XLA's notices for this torch_xla, and whether its compile cache came back with the checkpoint."""
    if runtime.name == "xla":
        restored = bool(resumed and compile_cache and any(compile_cache.iterdir()))
        for notice in runtime_notices(runtime.device_type, versions["torch_xla"], restored):
            log(notice)


def make_loaders(cfg: TrainConfig, train_shards: list, val_shards: list, resumed: LoadedCheckpoint | None,
                 log) -> tuple[TokenLoader, TokenLoader | None]:
    """The training loader (at the checkpoint's position when resuming) and the validation loader, if evaluating."""
    block = cfg.model.shape.block_size
    loader = TokenLoader(train_shards, cfg.step.micro_batch, block, seed=cfg.model.seed,
                         state=LoaderState.from_dict(resumed.state["loader"]) if resumed else None,
                         on_change=cfg.data.on_data_change)
    if loader.changed:
        log(f"the training shards changed since the checkpoint ({loader.changed}): epoch {loader.state.epoch} "
            "starts now over the shards given")
    val_loader = (TokenLoader(val_shards, cfg.step.micro_batch, block, shuffle=False)
                  if val_shards and cfg.evals.eval_every else None)
    if val_loader and cfg.evals.eval_batches > val_loader.batches_per_pass():
        log(f"notice: the validation shards hold {val_loader.batches_per_pass()} batches, fewer than --eval-batches "
            f"{cfg.evals.eval_batches}; each eval uses those {val_loader.batches_per_pass()}")
    return loader, val_loader


def make_model(cfg: TrainConfig, runtime: Runtime, resumed: LoadedCheckpoint | None, attention: AttentionChoice) -> GPT:
    """The model with the session's `attention`, initialised on the CPU from the seed so every backend starts
    identically; or the checkpoint's weights and RNG state when resuming."""
    torch.manual_seed(cfg.model.seed)
    model = GPT(cfg.model.shape, attention)  # the kernel the session chose for these shapes
    if cfg.model.zero_init_projections and not resumed:
        model.zero_output_projections()
    if resumed:
        model.load_checkpoint_tensors(resumed.model, resumed.path)
        runtime.set_rng_state(resumed.state.get("rng", {}))
    return model


def restore_grad_scaler(train_step, resumed: LoadedCheckpoint | None) -> None:
    """fp16's loss scale where the checkpoint carries one (bf16 and fp32 runs have none)."""
    if resumed and resumed.state.get("grad_scaler") and train_step.scaler.is_enabled():
        train_step.scaler.load_state_dict(resumed.state["grad_scaler"])


def session_clock(session: SessionSettings, resumed: LoadedCheckpoint | None, num_params: int, session_start: float,
                  started: float | None, startup_parts: dict | None) -> tuple[CheckpointTimer, SessionClock]:
    """The checkpoint's timer (last session's measured write, else an estimate) and the session's time budget, from
    the session's settings."""
    measured = resumed.state.get("timings", {}).get("checkpoint_seconds") if resumed else None
    ckpt_timer = CheckpointTimer(measured or estimate_checkpoint_seconds(num_params))
    budget = session.time_budget
    if budget and budget < ckpt_timer.seconds:
        raise UserError(f"--time-budget {budget:g}s is shorter than one checkpoint "
                        f"(~{ckpt_timer.seconds:.0f}s for {num_params / 1e6:.1f}M parameters)")
    # A budget given is training time, counted once start-up (probes, compiles, the baseline eval) has ended; the
    # default is a whole session's length, counted from here (shared/session_clock.py).
    clock = SessionClock(session_start if started is None else min(started, session_start), session_start,
                         budget or default_time_budget(ckpt_timer.seconds), session.session_deadline,
                         dict(startup_parts or {}), budget_after_startup=bool(budget))
    return ckpt_timer, clock


def start_logging(cfg: TrainConfig, runtime: Runtime, versions: dict, model: GPT, resumed: LoadedCheckpoint | None,
                  clock: SessionClock, log, wandb_key: str | None) -> MetricsLogger:
    """The metrics log, its history the checkpoint's copy (steps a killed session logged after its checkpoint are
    dropped); its session_start record, and the session's description in the log."""
    out_dir, start_step = Path(cfg.session.out_dir), resumed.step if resumed else 0
    metrics_path = out_dir / METRICS_FILE
    out_dir.mkdir(parents=True, exist_ok=True)
    if runtime.is_main and resumed and (resumed.path / METRICS_FILE).exists():
        shutil.copyfile(resumed.path / METRICS_FILE, metrics_path)
    elif runtime.is_main and metrics_path.exists():
        metrics_path.unlink()
    logging = cfg.logging
    logger = MetricsLogger(out_dir, cfg.lr_schedule.total_steps, start_step, cfg.to_dict(), logging.wandb_project,
                           logging.run_name, progress=logging.progress, log=log, enabled=runtime.is_main,
                           run_id=logging.wandb_run_id, wandb_key=wandb_key)
    tpu = runtime.tpu_generation
    logger.write({"event": "session_start", "step": start_step, "tokens": start_step * cfg.step.total_batch_tokens,
                  "device": runtime.description, "versions": versions, "time_budget_s": round(clock.budget_s, 1),
                  "session_deadline_s": cfg.session.session_deadline or None,
                  "micro_batch": cfg.step.micro_batch, "attention": model.attention.kind,
                  "tpu": tpu.name if tpu else None,
                  "unix_time": round(time.time(), 1), "elapsed_s": round(time.monotonic() - clock.train_start, 3)})
    log(f"{runtime.description}: {cfg.model.preset} ({model.num_params() / 1e6:.2f}M params), {cfg.grad_accum_steps} "
        f"micro-steps of {cfg.step.micro_batch}x{cfg.model.shape.block_size} per step, "
        f"{'resuming at step ' + str(start_step) + ' from ' + str(resumed.path) if resumed else 'fresh start'}")
    log(", ".join(f"{name} {version or '-'}" for name, version in versions.items())
        + (f"; TPU {tpu.name} from {runtime.tpu_generation_source}" if tpu
           else f"; {runtime.tpu_generation_source}" if runtime.tpu_generation_source else ""))
    if runtime.device_type == "TPU" and plan_versions_notice(versions):
        log(plan_versions_notice(versions))
    new_stable_end = stable_phase_end(cfg)
    if cfg.lr_schedule.extend and resumed and logger.enabled and new_stable_end and start_step < new_stable_end:
        log_projection(cfg, logger, start_step, new_stable_end)  # the longer run's end, from the evals so far
    return logger


def session_end_record(cfg: TrainConfig, runtime: Runtime, clock: SessionClock, step: int, stop_reason: str,
                       first_step_end: float, last_step_end: float, compiled_at_start: tuple[float, int]) -> dict:
    """The session_end record: why it stopped, and the session boundary's cost (start-up to the end of the first
    step, last step to the final checkpoint, the session's compiles)."""
    return {"event": "session_end", "step": step, "tokens": step * cfg.step.total_batch_tokens,
            "stop_reason": stop_reason, "elapsed_s": round(time.monotonic() - clock.train_start, 3),
            "unix_time": round(time.time(), 1),
            "start_to_first_step_s": round(first_step_end - clock.train_start, 3),
            "startup_s": round(clock.since_session(first_step_end), 3),
            "last_step_to_checkpoint_s": round(time.monotonic() - last_step_end, 3),
            "compile_s": round(runtime.compile_seconds() - compiled_at_start[0], 3),
            "compiles": runtime.compile_count() - compiled_at_start[1],
            "compile_cache": runtime.compile_cache_stats()}
