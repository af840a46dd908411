"""The train stage: train sessions one after another (one kernel, one version per session), each resuming from
the checkpoint dataset and publishing to it, until total_steps, max_train_sessions, too little weekly quota for
one more session, or max_failed_sessions in a row without progress. After each session: its log, metrics and
plot come back, and its checkpoint is published from its output if it could not publish it itself."""

from __future__ import annotations

import json
import math
import shutil
import time
import uuid
from pathlib import Path

from scripts.chain.build import build_kernel
from scripts.chain.checkpoints import dataset_step, ensure_checkpoint_dataset, publish_from_output
from scripts.chain.client import ApiFailure
from scripts.chain.config import ChainConfig
from scripts.chain.context import StageContext
from scripts.chain.limits import MACHINE_SHAPES
from scripts.chain.tokenize_stage import data_sources
from shared.errors import UserError
from shared.kaggle.publish import PUBLISH_RECORD


class TrainStage:
    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.cfg = ctx.cfg

    def check_work_left(self) -> int:
        """The checkpoint dataset's step; a chain that has trained nothing yet and finds it at total_steps already
        is one line (before anything is pushed)."""
        ckpt_ref = self.ctx.ref(self.cfg.slug("checkpoints"))
        step = dataset_step(self.ctx, ckpt_ref)
        if step >= self.cfg.total_steps and not self.ctx.state.data["train_sessions"]:
            raise UserError(f"nothing to train: checkpoint dataset {ckpt_ref} already holds step {step} of "
                            f"total_steps {self.cfg.total_steps} (raise total_steps to train further)")
        return step

    def run(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        ckpt_ref = ctx.ref(cfg.slug("checkpoints"))
        ensure_checkpoint_dataset(ctx, ckpt_ref)
        sessions = ctx.state.data["train_sessions"]
        step = self.check_work_left()
        if step >= cfg.total_steps:
            return
        failures = sum(1 for _ in _trailing_failures(sessions))
        while step < cfg.total_steps:
            n = len(sessions) + (0 if sessions and not sessions[-1].get("ended") else 1)
            if cfg.max_train_sessions and n > cfg.max_train_sessions:
                ctx.log(f"stopping training after {cfg.max_train_sessions} sessions (max_train_sessions) at step "
                        f"{step} of {cfg.total_steps}")
                break
            if not sessions or sessions[-1].get("ended"):
                self.check_quota(step)
                sessions.append({"n": n, "key": f"train-{n}", "step_before": step})
                ctx.state.save()
            sess = sessions[-1]
            ref = ctx.ref(cfg.slug("train"))
            ctx.log(f"train session {n} of {sessions_total(cfg, n, step, sessions)}: {ref}, from step {step}")
            sess["version"] = ctx.push_once(sess["key"], ref, lambda pid, at=step: self.build(pid, at))
            ctx.state.save()
            status, message, secs = ctx.wait(ref, f"{ref} v{sess['version']}", sess["key"])
            new_step, info = self.after_session(ref, sess, ckpt_ref)
            sess.update(ended=time.time(), status=status, message=message, seconds=round(secs, 1),
                        step_after=new_step, **info)
            ctx.state.save()
            failures = 0 if new_step > step else failures + 1
            self.report(sess, step, new_step, status, message, secs)
            step = new_step
            if failures >= cfg.max_failed_sessions:
                raise UserError(f"stopping: {failures} train sessions in a row made no progress (last: "
                                f"{message or status}); logs in {ctx.workdir / 'sessions'}")

    def build(self, push_id: str, expect_step: int = 0) -> Path:
        """The train kernel, expecting the checkpoint dataset at `expect_step` (it refuses to start over)."""
        ctx, cfg = self.ctx, self.cfg
        datasets, kernels, data_dir = data_sources(ctx)
        ckpt = ctx.ref(cfg.slug("checkpoints"))
        settings = {"progress": False, "run_name": cfg.name, **cfg.train, "data_dir": data_dir,
                    "out_dir": "{working}/train", "max_steps": cfg.total_steps,
                    "time_budget": cfg.time_budget, "wandb_run_id": self.wandb_run_id()}
        return build_kernel("train", ctx.workdir / "build" / "train", user=ctx.client.user, slug=cfg.slug("train"),
                            settings=settings, kernel_type=cfg.kernel_type, accelerator=cfg.accelerator,
                            internet=True, dataset_sources=[ckpt] + datasets, kernel_sources=kernels,
                            checkpoint_dataset={"dataset": ckpt, "resume_setting": "resume_from", "publish": True,
                                                "title": f"{cfg.name} checkpoints", "expect_step": expect_step},
                            push_id=push_id)

    def wandb_run_id(self) -> str:
        """One W&B run per chain, made once and kept in the state: every session resumes it, and no two chains
        (even of one name) share a run."""
        state = self.ctx.state
        if not state.data.get("wandb_run_id"):
            state.data["wandb_run_id"] = f"{self.cfg.name}-{uuid.uuid4().hex[:8]}"
            state.save()
        return state.data["wandb_run_id"]

    def quota_left_s(self) -> tuple[float, float, str] | None:
        """(seconds left, seconds allowed, reset time) of the accelerator's weekly quota, None for CPU."""
        return self.ctx.client.quota_left_s(MACHINE_SHAPES.get(self.cfg.accelerator))

    def check_quota(self, step: int) -> None:
        """Stop before a session the weekly quota could not cover (Kaggle would stop it part-way)."""
        cfg, quota = self.cfg, self.quota_left_s()
        if quota is not None and quota[0] < cfg.session_limit_s:
            kind = MACHINE_SHAPES.get(cfg.accelerator, "cpu").upper()
            raise UserError(
                f"stopping: the weekly {kind} quota would be exceeded: {quota[0] / 3600:.2f} h left of "
                f"{quota[1] / 3600:g} h, a session may use {cfg.session_limit_s / 3600:.2f} h; it resets at "
                f"{quota[2]}; run the chain again then (it continues at step {step})")

    def after_session(self, ref: str, sess: dict, ckpt_ref: str) -> tuple[int, dict]:
        """Fetch the session's log, metrics and plot; publish its checkpoint from its output if it could not."""
        ctx = self.ctx
        dest = ctx.workdir / "sessions" / f"train-{sess['n']:02d}"
        ctx.client.download_output(ref, dest, pattern=r"^(publish\.json|train/metrics\.jsonl|train/loss\.png)$",
                                   version=sess["version"])
        info: dict = {"logs": str(dest)}
        for name in ("metrics.jsonl", "loss.png"):
            if (dest / "train" / name).exists():
                shutil.copyfile(dest / "train" / name, ctx.workdir / name)
        record = {}
        if (dest / PUBLISH_RECORD).exists():
            record = json.loads((dest / PUBLISH_RECORD).read_text())
        ctx.client.wait_dataset_ready(ckpt_ref)
        step = dataset_step(ctx, ckpt_ref)
        out_step = record.get("step") or 0
        if out_step > step:  # the session saved a newer checkpoint than the dataset holds: publish it from here
            reason = record.get("reason") or "the session did not publish it"
            if publish_from_output(ctx, ref, sess["version"], ckpt_ref, out_step, reason):
                info["published_by"] = "chain"
                step = dataset_step(ctx, ckpt_ref)
        elif record.get("published"):
            info["published_by"] = "session"
        return max(step, 0), info

    def report(self, sess: dict, before: int, after: int, status: str, message: str, secs: float) -> None:
        """A few lines per session: steps, loss, tokens/s, sessions and quota left, where the logs are."""
        from shared.train.metrics import read_metrics

        ctx, cfg = self.ctx, self.cfg
        metrics = ctx.workdir / "metrics.jsonl"
        records = read_metrics(metrics) if metrics.exists() else []
        losses = [r for r in records if r.get("loss") is not None and before < r.get("step", 0) <= after]
        speeds = [r["tokens_per_s"] for r in losses[1:] if r.get("tokens_per_s")]
        loss = f"loss {losses[-1]['loss']:.4f}" if losses else "no loss logged"
        speed = f"{sum(speeds) / len(speeds):,.0f} tokens/s" if speeds else "tokens/s n/a"
        left = sessions_left(cfg, after, ctx.state.data["train_sessions"]) if after < cfg.total_steps else 0
        ctx.log(f"  session {sess['n']} {status.lower()} in {secs:.0f}s: step {before} -> {after} of "
                f"{cfg.total_steps}, {loss}, {speed}" + (f" ({message})" if message else ""))
        quota = None
        try:
            quota = self.quota_left_s()
        except ApiFailure:
            pass
        quota_text = (f", {MACHINE_SHAPES[cfg.accelerator].upper()} quota left {quota[0] / 3600:.2f} h "
                      f"(~{int(quota[0] // cfg.session_limit_s)} sessions)") if quota else ""
        ctx.log(f"  ~{left} more session(s){quota_text}")
        ctx.log(f"  logs: {sess.get('logs') or ''}  metrics: {metrics}  plot: {ctx.workdir / 'loss.png'}")


def _progressed(sessions: list) -> list:
    return [s for s in sessions if s.get("ended") and s.get("step_after", 0) > s.get("step_before", 0)]


def sessions_total(cfg: ChainConfig, n: int, step: int, sessions: list) -> str:
    """"~N" sessions in all (this one included), from the steps the finished ones made; "?" before any."""
    if not _progressed(sessions):
        return f"{cfg.max_train_sessions} (max_train_sessions)" if cfg.max_train_sessions else "?"
    total = n - 1 + sessions_left(cfg, step, sessions)
    if cfg.max_train_sessions and total > cfg.max_train_sessions:
        return f"{cfg.max_train_sessions} (max_train_sessions; ~{total} to reach total_steps)"
    return f"~{total}"


def sessions_left(cfg: ChainConfig, step: int, sessions: list) -> int:
    done = _progressed(sessions)
    if not done:
        return 1
    per = sum(s["step_after"] - s["step_before"] for s in done) / len(done)
    return max(1, math.ceil((cfg.total_steps - step) / per))


def _trailing_failures(sessions: list):
    for s in reversed(sessions):
        if not s.get("ended"):
            continue
        if s.get("step_after", 0) > s.get("step_before", 0):
            return
        yield s
