"""The training loop: one function, top to bottom, the same on TPU (XLA SPMD), XLA CPU devices and torch.

A session trains until max_steps, its time budget, SIGTERM, or --stop-after-steps, then writes a checkpoint;
the next session (a new process, maybe on another machine) resumes from it bit-exactly.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.checkpoint_names import STABLE_DIR
from shared.config import TrainConfig
from shared.data import LoaderState, TokenLoader, find_shards
from shared.errors import UserError
from shared.train.checkpoint import (
    METRICS_FILE,
    CheckpointTimer,
    LoadedCheckpoint,
    check_same_shape,
    checkpoint_name,
    latest_checkpoint,
    save_checkpoint,
    saved_state,
    set_aside_checkpoint,
)
from shared.train.clock import SessionClock, default_time_budget, estimate_checkpoint_seconds
from shared.train.device import make_runtime
from shared.train.metrics import BackgroundCalls, MetricsLogger, plot_loss
from shared.train.model import GPT
from shared.train.optim import (
    optimizer_of_state,
    optimizer_tensors,
    same_schedule_until,
    saved_schedule,
    stable_phase_end,
)
from shared.train.runtime import Runtime, runtime_versions
from shared.train.step import build_step, select_attention_and_micro_batch
from shared.train.validation import periodic_eval
from shared.train.xla_notices import runtime_notices

XLA_CACHE_DIR = "xla_cache"  # inside out_dir, and inside each checkpoint (XLA's persistent compilation cache)


def step_timing(per_step: dict[str, float], host_trace_s: float, sync_s: float, step_s: float) -> dict:
    """A logging window's timing, per step: host_trace_ms, the loop thread's CPU time building a step (data,
    tracing) before its sync (CPU time: a wait for the device in the middle is no host work); sync_ms, the sync's
    wall time (hashing and launching the graph, waiting if the runtime is still busy; the window's syncs up to its
    last step's, which the log cannot wait for); and where the runtime measures them (`device_timers`, per-step
    deltas): device_ms, the device running graphs; device_busy, device time over the window's wall time;
    device_waits, explicit waits for the device."""
    record = {"host_trace_ms": round(1e3 * host_trace_s, 2), "sync_ms": round(1e3 * sync_s, 2)}
    if per_step:
        record.update(device_ms=round(1e3 * per_step["execute_s"], 2),
                      device_busy=round(min(1.0, per_step["execute_s"] / max(step_s, 1e-9)), 4),
                      device_waits=round(per_step["device_waits"], 3))
    return record


@dataclass
class TrainResult:
    step: int
    last_loss: float | None
    checkpoint: Path | None
    stop_reason: str
    start_step: int = 0  # the step this session resumed from (--extend: maybe below the run's newest checkpoint)


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


def resume_point(cfg: TrainConfig, ckpt_root: Path, log=print) -> LoadedCheckpoint | None:
    """The checkpoint this session starts from: the newest that verifies in the run's checkpoints or
    --resume-from. With --extend, the newest that the new schedule agrees with (every update it holds made with
    the same learning rates), the stable-phase checkpoints included; the run's newer checkpoints, made on the
    shorter schedule, are then set aside, so this and every later session of the longer run go on from the right
    one. Nothing is renamed when no checkpoint agrees; with no checkpoint at all, the run starts at step 0."""
    roots = [ckpt_root, Path(cfg.resume_from) if cfg.resume_from else None]
    if not cfg.extend:
        return latest_checkpoint(*roots, log=log, set_aside=True)
    roots += [root / STABLE_DIR for root in roots if root]
    passed_over: dict[Path, str] = {}

    def superseded(path: Path) -> bool:
        was, step = saved_schedule(cfg, saved_state(path))
        if same_schedule_until(was, cfg, step):
            return False
        passed_over[path] = f"step {step} of a {was.max_steps}-step {was.schedule} schedule"
        return True

    try:
        resumed = latest_checkpoint(*roots, log=log, set_aside=True, superseded=superseded)
    except UserError:
        if not passed_over:
            raise
        resumed = None
    if resumed is None and not passed_over:  # nothing to extend yet (a chain's first session, a smoke run)
        log(f"--extend: no checkpoint yet in {', '.join(str(r) for r in roots if r)}; training from step 0")
        return None
    if resumed is None:
        found = "; ".join(f"{path}: {what}" for path, what in passed_over.items())
        raise UserError(f"--extend --max-steps {cfg.max_steps}: no checkpoint in "
                        f"{', '.join(str(r) for r in roots if r)} agrees with this schedule (a wsd run keeps the one "
                        f"where its stable phase ends in {STABLE_DIR}/; the new decay must start later)"
                        + (f"; passed over {found}" if found else ""))
    owned = (ckpt_root, ckpt_root / STABLE_DIR)  # --resume-from is another run's, or a read-only dataset
    for path, what in passed_over.items():
        if path.parent in owned:
            set_aside_checkpoint(path, f"--extend: {path} ({what}) holds updates --max-steps {cfg.max_steps} "
                                       "makes differently", log=log)
    log(f"--extend: training on from step {resumed.step} ({resumed.path}) to step {cfg.max_steps}")
    return resumed


class StepLog:
    """The loop's metric lines. `queue` runs as a step closure once a logged step is launched, so its host-side
    counts include that step's compilation, graph launch and tokens; the device values (loss, grad norm, LR)
    are read by `background` (a thread under XLA) while the loop goes on tracing the next step. Each line
    reports the window since the previous one."""

    def __init__(self, runtime: Runtime, logger: MetricsLogger, background: BackgroundCalls, step: int,
                 tokens_per_step: int, flops_per_token: float, session_start: float):
        self.runtime, self.logger, self.background = runtime, logger, background
        self.tokens_per_step, self.flops_per_token, self.session_start = tokens_per_step, flops_per_token, session_start
        self.peak = runtime.peak_flops()
        self.last_loss: float | None = None
        self._window_start = {"time": time.monotonic(), "step": step, "host_trace_s": 0.0, "sync_s": 0.0,
                              **runtime.device_timers()}

    def queue(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: torch.Tensor, host_trace_s: float,
              sync_s: float) -> None:
        # The previous line must be written first: the device is busy with this step meanwhile, and a read the
        # runtime kept waiting (its device lock goes to the loop's syncs first) is late by one window at most.
        self.background.flush()
        h2d, _ = self.runtime.transfer_counts()
        counts = {"compiles": self.runtime.compile_count(), "graphs": self.runtime.execution_count(),
                  "h2d_transfers": h2d}
        self.background.submit(self._write, step, loss, grad_norm, lr, host_trace_s, sync_s, counts)

    def _write(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, lr: torch.Tensor, host_trace_s: float,
               sync_s: float, counts: dict) -> None:
        # Under XLA this runs on the background thread: reading the values waits for the device to finish the
        # step. They are read first, so the window's clock stops once the device has finished the step, not when
        # it was queued. Every other device-to-host read (evals, checkpoints) waits for this one first, so the
        # count read after it is exact.
        self.last_loss = self.runtime.mean_across(loss).item()
        lr_value, grad_norm_value = lr.item(), grad_norm.item()
        now, timers = time.monotonic(), self.runtime.device_timers()
        start = self._window_start
        steps, seconds = step - start["step"], max(now - start["time"], 1e-9)
        per_step = {key: (timers[key] - start[key]) / steps for key in timers}
        tokens_per_s = steps * self.tokens_per_step / seconds
        self.logger.write({"step": step, "loss": self.last_loss, "lr": lr_value, "grad_norm": grad_norm_value,
                           "tokens": step * self.tokens_per_step, "tokens_per_s": round(tokens_per_s, 1),
                           "mfu": tokens_per_s * self.flops_per_token / self.peak if self.peak else None,
                           "elapsed_s": round(now - self.session_start, 3), **counts,
                           "d2h_transfers": self.runtime.transfer_counts()[1],
                           **step_timing(per_step, (host_trace_s - start["host_trace_s"]) / steps,
                                         (sync_s - start["sync_s"]) / steps, seconds / steps)})
        self._window_start = {"time": now, "step": step, "host_trace_s": host_trace_s, "sync_s": sync_s, **timers}


class Evaluator:
    """Decides when to evaluate and does it: every `eval_every` steps, where there are validation shards, and at
    a session's start (its baseline, which also compiles the eval graphs before the first step). An eval is the
    validation loss, and the HellaSwag subset and a sample where configured (shared/train/validation.py)."""

    def __init__(self, model: GPT, runtime: Runtime, cfg: TrainConfig, val_loader: TokenLoader | None,
                 logger: MetricsLogger, background: BackgroundCalls):
        self.model, self.runtime, self.cfg, self.val_loader = model, runtime, cfg, val_loader
        self.logger, self.background = logger, background
        self.active = val_loader is not None and cfg.eval_every > 0

    def baseline(self, step: int) -> None:
        if self.active and step < self.cfg.max_steps:
            self._run(step)

    def maybe_run(self, step: int) -> None:
        if self.active and step % self.cfg.eval_every == 0:
            self._run(step)

    def _run(self, step: int) -> None:
        self.background.flush()  # the logged steps before the eval's records
        periodic_eval(self.model, self.runtime, self.cfg, step, step * self.cfg.total_batch_tokens, self.val_loader,
                      self.logger)


class Checkpointer:
    """Decides when to write a checkpoint and times each write: every `checkpoint_every` steps, where a wsd
    run's stable phase ends (apart, in <root>/stable/, out of rotation: --extend trains on from it), and at the
    session's end. `write(root, step, keep)` is the trainer's: it gathers the tensors and saves them."""

    def __init__(self, cfg: TrainConfig, root: Path, step: int, timer: CheckpointTimer,
                 write: Callable[[Path, int, int], Path]):
        self.cfg, self.root, self.timer, self.write = cfg, root, timer, write
        self.stable_end = stable_phase_end(cfg) if cfg.keep_stable else None
        self.saved_step = step

    def maybe_save(self, step: int) -> None:
        every = self.cfg.checkpoint_every
        if every and step % every == 0 and step < self.cfg.max_steps:
            self.write(self.root, step, self.cfg.keep_checkpoints)
            self.saved_step = step
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
            return self.write(self.root, step, self.cfg.keep_checkpoints)
        if step > start_step:
            return self.root / checkpoint_name(step)
        return resumed.path if resumed else None  # nothing trained: the run was already complete


def train(cfg: TrainConfig, runtime: Runtime | None = None, log=print, wandb_key: str | None = None,
          started: float | None = None, startup_parts: dict | None = None) -> TrainResult:
    """One session. `started`: the monotonic time the session began (a kernel's process start), which
    --session-deadline counts from (default: now); `startup_parts`: seconds spent before this call, by name."""
    session_start = time.monotonic()
    cfg.validate()  # the flags; the device count is checked once the runtime is up
    model_cfg = cfg.model
    out_dir = Path(cfg.out_dir)
    ckpt_root = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else out_dir / "checkpoints"
    metrics_path = out_dir / METRICS_FILE

    # --- data and resume point -------------------------------------------------------------------------
    train_shards, val_shards = find_shards(cfg.data_dir, "train"), find_shards(cfg.data_dir, "val")
    if not train_shards:
        raise UserError(f"--data-dir {cfg.data_dir}: no *_train_*.bin token shards found")
    resumed = resume_point(cfg, ckpt_root, log)
    if resumed:
        check_same_shape(resumed, model_cfg.to_dict())
        saved_with = optimizer_of_state(resumed.optimizer)
        if saved_with != cfg.optimizer:
            raise UserError(f"--optimizer {cfg.optimizer}: the checkpoint {resumed.path} holds {saved_with}'s "
                            f"state; resume with --optimizer {saved_with} (or start a new run in another --out-dir)")

    # --- runtime: XLA starts with the compiled graphs of the previous session when the checkpoint has them ---
    compile_cache = restore_compile_cache(resumed, out_dir) if cfg.xla_cache else None
    runtime = runtime or make_runtime(cfg.backend, compile_cache)
    versions = runtime_versions()
    if runtime.name == "xla":
        restored = bool(resumed and compile_cache and any(compile_cache.iterdir()))
        for notice in runtime_notices(runtime.device_type, versions["torch_xla"], restored):
            log(notice)
    if not runtime.is_main:  # under DDP one process speaks for all
        log = lambda *args, **kwargs: None  # noqa: E731
    compile_at_start, compiles_at_start = runtime.compile_seconds(), runtime.compile_count()
    cfg.validate(runtime.num_devices)
    cfg = select_attention_and_micro_batch(cfg, runtime, log)
    accum = cfg.grad_accum_steps
    loader = TokenLoader(train_shards, cfg.micro_batch, model_cfg.block_size, seed=cfg.seed,
                         state=LoaderState.from_dict(resumed.state["loader"]) if resumed else None,
                         on_change=cfg.on_data_change)
    if loader.changed:
        log(f"the training shards changed since the checkpoint ({loader.changed}): epoch {loader.state.epoch} "
            "starts now over the shards given")
    val_loader = (TokenLoader(val_shards, cfg.micro_batch, model_cfg.block_size, shuffle=False)
                  if val_shards and cfg.eval_every else None)
    if val_loader and cfg.eval_batches > val_loader.batches_per_pass():
        log(f"notice: the validation shards hold {val_loader.batches_per_pass()} batches, fewer than --eval-batches "
            f"{cfg.eval_batches}; each eval uses those {val_loader.batches_per_pass()}")

    # --- model and optimizer: initialised on the CPU from the seed, so every backend starts identically ---
    torch.manual_seed(cfg.seed)
    model = GPT(model_cfg)
    if cfg.zero_init_projections and not resumed:
        model.zero_output_projections()
    if resumed:
        model.load_checkpoint_tensors(resumed.model, resumed.path)
        runtime.set_rng_state(resumed.state.get("rng", {}))
    start_step = resumed.step if resumed else 0
    train_step = build_step(cfg, runtime, model, start_step, resumed.optimizer if resumed else None)
    plan, opt, scaler, named_params = train_step.plan, train_step.opt, train_step.scaler, train_step.named_params
    if resumed and resumed.state.get("grad_scaler") and scaler.is_enabled():
        scaler.load_state_dict(resumed.state["grad_scaler"])

    # --- time budget ---------------------------------------------------------------------------------------
    num_params = model.num_params()
    measured = resumed.state.get("timings", {}).get("checkpoint_seconds") if resumed else None
    ckpt_timer = CheckpointTimer(measured or estimate_checkpoint_seconds(num_params))
    clock = SessionClock(session_start if started is None else min(started, session_start), session_start,
                         cfg.time_budget or default_time_budget(ckpt_timer.seconds), cfg.session_deadline,
                         dict(startup_parts or {}))
    if cfg.time_budget and cfg.time_budget < ckpt_timer.seconds:
        raise UserError(f"--time-budget {cfg.time_budget:g}s is shorter than one checkpoint "
                        f"(~{ckpt_timer.seconds:.0f}s for {num_params / 1e6:.1f}M parameters)")

    # --- logging ---------------------------------------------------------------------------------------------
    # The history is the checkpoint's copy: steps a killed session logged after its checkpoint are dropped.
    out_dir.mkdir(parents=True, exist_ok=True)
    if runtime.is_main and resumed and (resumed.path / METRICS_FILE).exists():
        shutil.copyfile(resumed.path / METRICS_FILE, metrics_path)
    elif runtime.is_main and metrics_path.exists():
        metrics_path.unlink()
    tokens_per_step = cfg.total_batch_tokens
    logger = MetricsLogger(out_dir, cfg.max_steps, start_step, cfg.to_dict(), cfg.wandb_project, cfg.run_name,
                           progress=cfg.progress, log=log, enabled=runtime.is_main, run_id=cfg.wandb_run_id,
                           wandb_key=wandb_key)
    logger.write({"event": "session_start", "step": start_step, "tokens": start_step * tokens_per_step,
                  "device": runtime.description, "versions": versions, "time_budget_s": round(clock.budget_s, 1),
                  "session_deadline_s": cfg.session_deadline or None,
                  "micro_batch": cfg.micro_batch, "attention": runtime.attention,
                  "tpu": runtime.tpu_generation.name if runtime.tpu_generation
                  else None, "unix_time": round(time.time(), 1),
                  "elapsed_s": round(time.monotonic() - session_start, 3)})
    log(f"{runtime.description}: {cfg.preset} ({num_params / 1e6:.2f}M params), {accum} micro-steps of "
        f"{cfg.micro_batch}x{model_cfg.block_size} per step, "
        f"{'resuming at step ' + str(start_step) + ' from ' + str(resumed.path) if resumed else 'fresh start'}")
    log(plan.describe(runtime, accum))
    log(", ".join(f"{name} {version or '-'}" for name, version in versions.items())
        + (f"; TPU {runtime.tpu_generation.name} from {runtime.tpu_generation_source}" if runtime.tpu_generation
           else f"; {runtime.tpu_generation_source}" if runtime.tpu_generation_source else ""))
    flops_per_token = 6 * num_params + 12 * model_cfg.n_layer * model_cfg.n_embd * model_cfg.block_size

    stop_requested = threading.Event()
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())

    # Logging reads the device off the loop's thread, except with the scan over layers: torch_xla lowers the scan's
    # backward on autograd's device thread, and a device read on another thread meanwhile crashed the process
    # (segfault in scan.py's LoweringContext.build: 5 of 6 runs here; 0 of 3 with the reads in the loop's thread).
    background = BackgroundCalls(threaded=runtime.name == "xla" and not plan.scan_layers)

    def write_checkpoint(root: Path, step: int, keep: int) -> Path:
        background.flush()  # the logged steps before the checkpoint's record
        # Gathering sharded tensors to the host is the checkpoint's device-to-host transfer, off the step path.
        model_tensors = model.checkpoint_tensors()
        opt_tensors = optimizer_tensors(opt, named_params)
        path = root / checkpoint_name(step)
        if runtime.is_main:  # under DDP every process holds the same tensors; one writes them
            state = {"loader": loader.state.to_dict(), "rng": runtime.rng_state(), "config": {
                "train": cfg.to_dict(), "model": model_cfg.to_dict()},
                "timings": {"checkpoint_seconds": ckpt_timer.seconds}, "tokens": step * tokens_per_step,
                "grad_scaler": scaler.state_dict() if scaler.is_enabled() else None}
            extra = {XLA_CACHE_DIR: compile_cache} if compile_cache and runtime.name == "xla" else None
            path = ckpt_timer.time(save_checkpoint, root, step, model_tensors, opt_tensors, state,
                                   metrics_path, keep, extra)
        runtime.barrier()
        logger.write({"event": "checkpoint", "step": step, "tokens": step * tokens_per_step,
                      "checkpoint_s": round(ckpt_timer.seconds, 3), **({"stable": True} if root != ckpt_root else {}),
                      "elapsed_s": round(time.monotonic() - session_start, 3)})
        return path

    checkpointer = Checkpointer(cfg, ckpt_root, start_step, ckpt_timer, write_checkpoint)
    evaluator = Evaluator(model, runtime, cfg, val_loader, logger, background)
    step_log = StepLog(runtime, logger, background, start_step, tokens_per_step, flops_per_token, session_start)

    # --- the loop ----------------------------------------------------------------------------------------------
    evaluator.baseline(start_step)
    step, stop_reason = start_step, "max_steps"
    loop_start = first_step_end = last_step_end = time.monotonic()
    # Summed: the host's CPU time building steps (data, tracing), and the wall time of the syncs (hashing the graph,
    # launching it, and waiting for the runtime if the host is ahead).
    host_trace_s = sync_s = 0.0
    try:
        while step < cfg.max_steps:
            step_started, compile_before = time.monotonic(), runtime.compile_seconds()
            cpu_started = time.thread_time()  # the host's own work: blocking waits (back-pressure) are not in it
            tokens = np.stack([loader.next_batch() for _ in range(accum)])  # (accum, micro_batch, T+1)
            loss, grad_norm, lr = train_step(tokens)
            step += 1
            host_trace_s += time.thread_time() - cpu_started
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                runtime.add_step_closure(step_log.queue, (step, loss, grad_norm, lr, host_trace_s, sync_s))
            sync_started = time.monotonic()
            runtime.sync()  # launches the step; waits only for the previous step's graph to finish
            sync_s += time.monotonic() - sync_started
            # The next step costs what this one did, less any compilation (which does not recur).
            step_s = time.monotonic() - step_started - (runtime.compile_seconds() - compile_before)
            last_step_end = time.monotonic()
            if step == start_step + 1:
                first_step_end = last_step_end
                clock.first_step_done(step, loop_start, first_step_end, runtime.compile_seconds() - compile_before,
                                      ckpt_timer.seconds, logger.write, log)
            evaluator.maybe_run(step)
            checkpointer.maybe_save(step)
            if stop_requested.is_set():
                stop_reason = "SIGTERM"
                break
            if cfg.stop_after_steps and step - start_step >= cfg.stop_after_steps:
                stop_reason = "stop_after_steps"
                break
            # Under XLA the step just launched may still be running (the host runs a step ahead): count it too.
            in_flight = step_s if runtime.name == "xla" else 0.0
            if in_flight + step_s + checkpointer.seconds_after(step) > clock.left_s():
                stop_reason = "time_budget"
                break
        background.flush()
        path = checkpointer.final_save(step, start_step, resumed)
        # The session boundary's cost: start-up to the end of the first step, last step to final checkpoint.
        logger.write({"event": "session_end", "step": step, "tokens": step * tokens_per_step,
                      "stop_reason": stop_reason, "elapsed_s": round(time.monotonic() - session_start, 3),
                      "unix_time": round(time.time(), 1),
                      "start_to_first_step_s": round(first_step_end - session_start, 3),
                      "startup_s": round(clock.since_session(first_step_end), 3),
                      "last_step_to_checkpoint_s": round(time.monotonic() - last_step_end, 3),
                      "compile_s": round(runtime.compile_seconds() - compile_at_start, 3),
                      "compiles": runtime.compile_count() - compiles_at_start,
                      "compile_cache": runtime.compile_cache_stats()})
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        logger.close()
    logger_png = plot_loss(metrics_path, out_dir / "loss.png") if runtime.is_main else None
    log(f"session ended at step {step}/{cfg.max_steps} ({stop_reason}); checkpoint {path}; "
        f"metrics {metrics_path}; plot {logger_png}; {runtime.compile_count()} XLA compilations")
    return TrainResult(step, step_log.last_loss, path, stop_reason, start_step)
