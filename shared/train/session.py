"""The session around the step: where it resumes from, when it evaluates, the metric lines it logs and the
profiler; its checkpoint writes are shared/train/checkpoint_writer.py's. `shared.train.trainer.train` calls each by
name."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from shared.checkpoint_names import STABLE_DIR
from shared.config import TrainConfig
from shared.data import TokenLoader
from shared.errors import UserError
from shared.model.model import GPT
from shared.runtime.optim import (
    optimizer_of_state,
    same_schedule_until,
    saved_schedule,
    stable_phase_end,
)
from shared.runtime.runtime import Runtime
from shared.train.checkpoint import (
    LoadedCheckpoint,
    check_same_shape,
    latest_checkpoint,
    saved_state,
    set_aside_checkpoint,
)
from shared.train.metrics import BackgroundCalls, MetricsLogger, read_metrics
from shared.train.projection import project, projection_lines, projection_record
from shared.train.reference import check, check_lines, check_record
from shared.train.validation import periodic_eval


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


def resume_point(cfg: TrainConfig, ckpt_root: Path, log=print) -> LoadedCheckpoint | None:
    """The checkpoint this session starts from (`find_resume_point`), checked to hold this model's shape and this
    optimizer's state (`check_resumable`); None: a fresh start."""
    resumed = find_resume_point(cfg, ckpt_root, log)
    if resumed:
        check_resumable(cfg, resumed)
    return resumed


def find_resume_point(cfg: TrainConfig, ckpt_root: Path, log=print) -> LoadedCheckpoint | None:
    """The checkpoint this session starts from: the newest that verifies in the run's checkpoints or
    --resume-from. With --extend, the newest that the new schedule agrees with (every update it holds made with
    the same learning rates), the stable-phase checkpoints included; the run's newer checkpoints, made on the
    shorter schedule, are then set aside, so this and every later session of the longer run go on from the right
    one. Nothing is renamed when no checkpoint agrees; with no checkpoint at all, the run starts at step 0."""
    roots = [ckpt_root, Path(cfg.session.resume_from) if cfg.session.resume_from else None]
    if not cfg.lr_schedule.extend:
        return latest_checkpoint(*roots, log=log, set_aside=True)
    roots += [root / STABLE_DIR for root in roots if root]
    passed_over: dict[Path, str] = {}

    def superseded(path: Path) -> bool:
        was, step = saved_schedule(cfg, saved_state(path))
        if same_schedule_until(was, cfg, step):
            return False
        passed_over[path] = f"step {step} of a {was.lr_schedule.total_steps}-step {was.lr_schedule.schedule} schedule"
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
        raise UserError(f"--extend --total-steps {cfg.lr_schedule.total_steps}: no checkpoint in "
                        f"{', '.join(str(r) for r in roots if r)} agrees with this schedule (a wsd run keeps the one "
                        f"where its stable phase ends in {STABLE_DIR}/; the new decay must start later)"
                        + (f"; passed over {found}" if found else ""))
    owned = (ckpt_root, ckpt_root / STABLE_DIR)  # --resume-from is another run's, or a read-only dataset
    for path, what in passed_over.items():
        if path.parent in owned:
            set_aside_checkpoint(path, f"--extend: {path} ({what}) holds updates --total-steps "
                                       f"{cfg.lr_schedule.total_steps} makes differently", log=log)
    log(f"--extend: training on from step {resumed.step} ({resumed.path}) to step {cfg.lr_schedule.total_steps}")
    return resumed


def check_resumable(cfg: TrainConfig, resumed: LoadedCheckpoint) -> None:
    """The checkpoint holds this model's shape and this optimizer's state (one-line UserError otherwise)."""
    check_same_shape(resumed, cfg.model.shape.to_dict())
    saved_with = optimizer_of_state(resumed.optimizer)
    if saved_with != cfg.optim.optimizer:
        raise UserError(f"--optimizer {cfg.optim.optimizer}: the checkpoint {resumed.path} holds {saved_with}'s "
                        f"state; resume with --optimizer {saved_with} (or start a new run in another --out-dir)")


class StepLog:
    """The loop's metric lines. `queue` runs as a step closure once a logged step is launched, so its host-side
    counts include that step's compilation, graph launch and tokens; the device values (loss, grad norm, LR)
    are read by `background` (a thread under XLA) while the loop goes on tracing the next step. Each line
    reports the window since the previous one: under XLA one window's own tokens/s can be far off (its read may wait
    for the next step too); a session's tokens/s is summed over its windows (shared/train/throughput.py)."""

    def __init__(self, runtime: Runtime, logger: MetricsLogger, background: BackgroundCalls, step: int,
                 tokens_per_step: int, flops_per_token: float, session_start: float, flops_per_token_llmc: float = 0):
        self.runtime, self.logger, self.background = runtime, logger, background
        self.tokens_per_step, self.flops_per_token, self.session_start = tokens_per_step, flops_per_token, session_start
        self.flops_per_token_llmc = flops_per_token_llmc
        self.peak = runtime.peak_flops()
        self.last_loss: float | None = None
        self._first_line = True
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
        if self._first_line:  # written here, the loop waiting once: its read is where the session's throughput
            self._first_line = False  # is measured from (shared/train/throughput.py), so it must not be late
            self._write(step, loss, grad_norm, lr, host_trace_s, sync_s, counts)
            return
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
                           "mfu_llmc": (tokens_per_s * self.flops_per_token_llmc / self.peak
                                        if self.peak and self.flops_per_token_llmc else None),
                           "elapsed_s": round(now - self.session_start, 3), **counts,
                           "d2h_transfers": self.runtime.transfer_counts()[1],
                           **step_timing(per_step, (host_trace_s - start["host_trace_s"]) / steps,
                                         (sync_s - start["sync_s"]) / steps, seconds / steps)})
        self._window_start = {"time": now, "step": step, "host_trace_s": host_trace_s, "sync_s": sync_s, **timers}


class Evaluator:
    """Decides when to evaluate and does it: every `eval_every` steps, where there are validation shards, at the
    run's last step and where a wsd run's stable phase ends (the checkpoints a decision reads), and at a session's
    start (its baseline, which also compiles the eval graphs before the first step). An eval is the validation
    loss, the HellaSwag subset (every `hellaswag_every` steps, and at those two steps) and a sample where
    configured (shared/train/validation.py)."""

    def __init__(self, model: GPT, runtime: Runtime, cfg: TrainConfig, val_loader: TokenLoader | None,
                 logger: MetricsLogger, background: BackgroundCalls):
        self.model, self.runtime, self.cfg, self.val_loader = model, runtime, cfg, val_loader
        self.logger, self.background = logger, background
        self.active = val_loader is not None and cfg.evals.eval_every > 0
        self.stable_end = stable_phase_end(cfg)
        self.key_steps = {cfg.lr_schedule.total_steps, self.stable_end} - {None}
        self.hellaswag_step = -1  # the last eval that scored HellaSwag

    def baseline(self, step: int) -> None:
        if self.active and step < self.cfg.lr_schedule.total_steps:
            self._run(step, hellaswag=True)

    def maybe_run(self, step: int) -> None:
        if self.active and (step % self.cfg.evals.eval_every == 0 or step in self.key_steps):
            # HellaSwag at the first eval at or past each multiple of hellaswag_every (whatever eval_every is).
            every = self.cfg.evals.hellaswag_every
            due = not every or step // every > self.hellaswag_step // every
            self._run(step, hellaswag=due or step in self.key_steps)

    def _run(self, step: int, hellaswag: bool) -> None:
        if hellaswag:
            self.hellaswag_step = step
        self.background.flush()  # the logged steps before the eval's records
        results = periodic_eval(self.model, self.runtime, self.cfg, step, step * self.cfg.step.total_batch_tokens,
                                self.val_loader, self.logger, hellaswag)
        if self.logger.enabled:
            log_reference_check(self.cfg, self.logger, step, results)
        if step == self.stable_end and self.logger.enabled:  # the decision point: where will the decay end?
            log_projection(self.cfg, self.logger, step, step)


def log_reference_check(cfg: TrainConfig, logger: MetricsLogger, step: int, results: dict) -> None:
    """A gpt2 run's eval held against a published run's curve (shared/train/reference.py): log lines and a record,
    from 0.5B tokens on, with the early verdict from 2B tokens on."""
    if cfg.model.preset != "gpt2" or cfg.model.shape.block_size != 1024 or results.get("val_loss") is None:
        return
    batch = cfg.step.total_batch_tokens
    found = check(step, step * batch, results["val_loss"], cfg.lr_schedule.total_steps, batch,
                  results.get("hellaswag_acc_norm"), results.get("hellaswag_examples") or 10_042)
    if found is None:
        return
    for line in check_lines(found):
        logger.log(line)
    logger.write(check_record(found))


def log_projection(cfg: TrainConfig, logger: MetricsLogger, at_step: int, stable_end: int) -> None:
    """Where the run will end (shared/train/projection.py), from its evals up to at_step: log lines and a record."""
    found = project(read_metrics(logger.path), cfg, at_step, stable_end)
    if found is None:
        return
    for line in projection_lines(found, cfg):
        logger.log(line)
    logger.write({"step": at_step, "event": "projection", **projection_record(found)})


class StepProfiler:
    """torch_xla's profiler over `cfg.logging.profile_steps` steps of a session once its step graph has compiled
    (steps 1 and 2 compile), written to <out_dir>/profile/ (an .xplane.pb under plugins/profile/, which
    TensorBoard's profile plugin reads): the device's per-op time of a real TPU step, to hold against
    scripts/hlo_cost.py's roofline. A profiler that fails is one notice; training goes on. Where the trace starts
    and stops is recorded too (`profile_start`, `profile_end` through `record`, metrics.jsonl, after the step lines
    queued before them): the throughput leaves those steps out (shared/train/throughput.py)."""

    def __init__(self, cfg: TrainConfig, runtime: Runtime, start_step: int, log,
                 record: Callable[[dict], None] = lambda record: None):
        self.first, self.last = start_step + 2, start_step + 2 + cfg.logging.profile_steps
        self.active = cfg.logging.profile_steps > 0 and runtime.name == "xla" and runtime.is_main
        self.folder, self.log, self.record, self.tracing = Path(cfg.session.out_dir) / "profile", log, record, False
        self.step = start_step  # the last step launched

    def after(self, step: int) -> None:
        """Called once step `step` has been launched: starts the trace after the first compiled-once step, stops
        it `profile_steps` steps later."""
        self.step = step
        if self.active and step == self.first:
            self.record({"step": step, "event": "profile_start"})
            self._call("start", lambda xp: xp.start_trace(str(self.folder)))
            self.tracing = self.active
        elif self.tracing and step >= self.last:
            self.close()
            self.log(f"profiled steps {self.first + 1}-{step} (torch_xla's profiler): {self.folder}")

    def close(self) -> None:
        """Stops a trace still running (the session ended inside it)."""
        if self.tracing:
            self.tracing = False
            self._call("stop", lambda xp: xp.stop_trace())
            self.record({"step": self.step, "event": "profile_end"})

    def _call(self, what: str, fn: Callable) -> None:
        try:
            import torch_xla.debug.profiler as xp

            fn(xp)
        except Exception as err:  # a profiler that cannot start or write: no trace, and training goes on
            self.active = self.tracing = False
            self.log(f"notice: the profiler's {what} failed ({type(err).__name__}: {str(err)[:200]}); no trace")
