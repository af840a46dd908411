"""The train stage: train sessions one after another (one kernel, one version per session), each resuming from
the checkpoint dataset that holds the newest proven checkpoint and publishing to the other of the two
(scripts/chain/checkpoints.py `publish_target`), until total_steps, max_train_sessions, too little weekly quota for
one more session, or max_failed_sessions in a row without progress. After each session: its log, metrics and
plot come back, and its checkpoint is published from its output if it could not publish it itself."""

from __future__ import annotations

import json
import math
import re
import shutil
import time
import uuid
from pathlib import Path

from scripts.chain.attention_carry import PROBES_FACT, carried_attention, probe_results
from scripts.chain.build import build_kernel
from scripts.chain.checkpoint_room import publish_verify_s
from scripts.chain.checkpoints import (
    checkpoint_refs,
    dataset_step,
    download_dataset_file,
    ensure_checkpoint_dataset,
    newest_proven,
    note_version,
    publish_from_output,
    publish_target,
    read_private_datasets,
    session_publishes,
    version_problem,
)
from scripts.chain.client import ApiFailure, VersionMissing, log_error_line
from scripts.chain.config import ChainConfig
from scripts.chain.context import StageContext
from scripts.chain.hellaswag import ensure_hellaswag_dataset, hellaswag_settings
from scripts.chain.limits import MACHINE_SHAPES
from scripts.chain.measured import keep_session_facts
from scripts.chain.notebooks import attach_line
from scripts.chain.sizing import session_length, session_measurements
from scripts.chain.storage import session_disk
from scripts.chain.tokenize_stage import data_sources
from shared.checkpoint_names import STATE_FILE
from shared.errors import UserError
from shared.kaggle.checkpoint_files import STABLE_PREFIX
from shared.kaggle.credential import CANNOT_PUBLISH, credential_secrets
from shared.kaggle.facts import FACTS_FILE
from shared.kaggle.publish import PUBLISH_RECORD


class TrainStage:
    def __init__(self, ctx: StageContext):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.extend_from: int | None = None  # train.extend: the step the next session resumes from, once said
        self.resume_ref: str | None = None  # the checkpoint dataset holding the newest proven checkpoint

    def check_work_left(self) -> tuple[int, int]:
        """(current version, step) of the checkpoint dataset holding the newest checkpoint of the two (kept as
        `resume_ref`); a chain that has trained nothing yet and finds it at total_steps already is one line (before
        anything is pushed), and so is a train.extend that no checkpoint of that version agrees with."""
        ckpt_ref, version, step = newest_proven(self.ctx)
        self.resume_ref = ckpt_ref
        if step >= self.cfg.total_steps and not self.ctx.state.data["train_sessions"]:
            raise UserError(f"nothing to train: checkpoint dataset {ckpt_ref} already holds step {step} of "
                            f"total_steps {self.cfg.total_steps} (raise total_steps to train further)")
        if self.cfg.train.config.lr_schedule.extend and step:
            start = extend_start(self.ctx, ckpt_ref, version, self.cfg)
            if start < step and start != self.extend_from:
                self.extend_from = start
                self.ctx.log(f"train.extend: the next session trains on from step {start}, where the stable phase "
                             f"ended (version {version} of {ckpt_ref} carries it beside step {step})")
        return version, step

    def run(self) -> None:
        ctx, cfg = self.ctx, self.cfg
        refs = checkpoint_refs(ctx)
        for ckpt_ref in refs:
            ensure_checkpoint_dataset(ctx, ckpt_ref)
        read_private_datasets(ctx, refs)
        if cfg.hellaswag and not ctx.state.data.get("hellaswag_dataset"):
            ctx.state.data["hellaswag_dataset"] = ensure_hellaswag_dataset(ctx)
            ctx.state.save()
        sessions = ctx.state.data["train_sessions"]
        version, step = self.check_work_left()
        failures = sum(1 for _ in _trailing_failures(sessions))
        while step < cfg.total_steps:
            n = len(sessions) + (0 if sessions and not sessions[-1].get("ended") else 1)
            if cfg.max_train_sessions and n > cfg.max_train_sessions:
                ctx.log(f"stopping training after {cfg.max_train_sessions} sessions (max_train_sessions) at step "
                        f"{step} of {cfg.total_steps}")
                break
            if not sessions or sessions[-1].get("ended"):
                self.check_quota(step)
                self.new_session(n, step, version)
            sess = sessions[-1]
            ref = ctx.ref(cfg.slug("train"))
            ctx.log(f"train session {n} of {sessions_total(cfg, n, step, sessions)}: {ref}, from step {step}")
            sess["version"] = ctx.push_once(sess["key"], ref, lambda pid, s=sess: self.build(
                pid, s["step_before"], s.get("ckpt_version", 0), s.get("delete_old", False), s.get("limit_s"),
                s.get("stop_after_steps", 0), s.get("midway", True), s.get("attention"), resume_ref=s.get("ckpt_ref"),
                publish_ref=s.get("publish_ref"), train_s=s.get("train_s", 0)), limit_s=sess.get("limit_s"))
            ctx.state.save()
            status, message, secs = ctx.wait(ref, f"{ref} v{sess['version']}", sess["key"])
            version, new_step, info = self.after_session(ref, sess, sess.get("ckpt_ref") or refs[0])
            self.resume_ref = info["ckpt_ref_after"]
            sess.update(ended=time.time(), status=status, message=message, seconds=round(secs, 1),
                        step_after=new_step, **info)
            ctx.state.save()
            failures = 0 if new_step > start_of(sess) else failures + self.no_progress(sess)
            ctx.state.save()
            self.report(sess, start_of(sess), new_step, status, message, secs)
            step = new_step
            self.stop_if_bound_to_repeat(sess, ref, step)
            if failures >= cfg.max_failed_sessions:
                raise UserError(f"stopping: {failures} train sessions in a row made no progress (last: "
                                f"{sess.get('error') or message or status}); logs in {ctx.workdir / 'sessions'}")

    def new_session(self, n: int, step: int, version: int) -> None:
        """Record session `n` before its push: the checkpoint dataset, version and step it must resume from
        (`resume_ref`), the other one it publishes to (`publish_target`: its versions may be deleted, never those of
        the newest proven checkpoint) and that one's version now, whether its publish deletes the older versions
        there, whether it publishes midway (both under the dataset quota: session_publishes), and its time limit."""
        ctx = self.ctx
        sessions = ctx.state.data["train_sessions"]
        length = session_length(self.cfg, sessions)
        if length.why:
            ctx.log(f"train session {n} lasts at most {length.limit_s:g} s (session_limit_s): {length.why}")
        resume = self.resume_ref or checkpoint_refs(ctx)[0]
        target = publish_target(ctx, resume if step else None)
        before = version if target == resume else ctx.client.dataset_version(target)[0]
        delete_old, midway = session_publishes(ctx, before, length.limit_s, ref=target)
        attention, why = carried_attention(self.cfg.train.config.step.attention, sessions)
        if why:
            self.ctx.log(f"train session {n} starts from the {attention} attention kernel (train.attention "
                         f"\"{attention}\"): {why}")
        sessions.append({"n": n, "key": f"train-{n}", "step_before": step, "ckpt_ref": resume,
                         "ckpt_version": version, "publish_ref": target, "publish_version": before,
                         "delete_old": delete_old, "midway": midway, "limit_s": length.limit_s,
                         **({"stop_after_steps": length.stop_after_steps} if length.stop_after_steps else {}),
                         **({"train_s": length.train_s} if length.train_s else {}),
                         **({"attention": attention} if why else {})})
        self.ctx.state.save()

    def no_progress(self, sess: dict) -> int:
        """A session that trained no step: 1 more failure in a row, or 0 where the chain sizes its sessions from
        what they measured and the next one is longer (a session killed at its limit before its first step ended
        took at least that limit to start up). One that could not fit a step at the longest its sessions may be
        is one line at once: no later session would do better."""
        cfg, limit = self.cfg, sess.get("limit_s") or self.cfg.session_limit_s
        if cfg.session_train_s and not sess.get("startup_s") and sess.get("seconds", 0) >= limit:
            sess["startup_s"] = limit - cfg.publish_margin_s  # a lower bound: the session ran out first
        startup = sess.get("startup_s")
        if (cfg.session_train_s and startup
                and session_length(cfg, self.ctx.state.data["train_sessions"]).limit_s > limit):
            sess["lengthened"] = True  # not a failure, after a restart too (_trailing_failures)
            self.ctx.log(f"  session {sess['n']} trained no step in its {limit:g} s after a {startup or 0:.0f}-s "
                         "start-up: the next session is longer")
            return 0
        if sess.get("stop_reason") == "too_short":
            # Training's budget counts from the end of the first step: only the deadline (the limit less publishing)
            # can leave no room for a step, so a smaller startup_margin_s would not help.
            setting = ("session_limit_s" if cfg.session_train_s else "session_limit_s (at most the machine's limit), "
                       "or shorten start-up (its log says what took the time, by part)")
            raise UserError(f"stopping: train session {sess['n']} could not fit one step: its start-up took "
                            f"{startup:.0f} s to the end of the first step, in a session of {limit:g} s with "
                            f"publish_margin_s {cfg.publish_margin_s:g}; raise {setting}")
        return 1

    def stop_if_bound_to_repeat(self, sess: dict, ref: str, step: int) -> None:
        """One line at once for a session that stopped before training because no credential of its own could
        publish its checkpoints (kept in /kaggle/temp, they would be lost): every later session would stop the same
        way until the user attaches the key, so none is pushed meanwhile."""
        line = sess.get("error") or ""
        if sess.get("status") != "ERROR" or not line.startswith(f"error: {CANNOT_PUBLISH}"):
            return
        sess["bound_to_repeat"] = True  # not a failure in a row once the user has attached the key (_trailing_failures)
        self.ctx.state.save()
        attach = attach_line("train", ref, credential_secrets(self.ctx.client.api))
        raise UserError(f"stopping: train session {sess['n']} stopped before training, as every later one would: "
                        f"{line.removeprefix('error: ')}. {attach[0].upper()}{attach[1:]}, then run the same command "
                        f"again (it goes on at step {step})")

    def build(self, push_id: str, expect_step: int = 0, expect_version: int = 0, delete_old: bool = False,
              limit_s: float | None = None, stop_after_steps: int = 0, midway: bool = True,
              attention: str | None = None, resume_ref: str | None = None, publish_ref: str | None = None,
              train_s: float = 0) -> Path:
        """The train kernel, expecting version `expect_version` of the checkpoint dataset at `expect_step`: a mount
        of an older version is replaced by that version, fetched, and it never starts over. `limit_s`: the session's
        time limit (default session_limit_s); `stop_after_steps`: the steps after which it ends (0: its clock);
        `midway`: whether a session long enough publishes midway too (False where the dataset quota has no room);
        `attention`: the kernel it starts from, where an earlier session's hung or failed (else train.attention);
        `resume_ref`, `publish_ref`: the checkpoint datasets it resumes from and publishes to (default: the first);
        `train_s`: a sized session's training, counted from the end of its first step (0: until its deadline).
        Both checkpoint datasets are attached."""
        ctx, cfg = self.ctx, self.cfg
        datasets, kernels, data_dir = data_sources(ctx)
        ckpt = resume_ref or checkpoint_refs(ctx)[0]
        ckpts = list(dict.fromkeys([ckpt, publish_ref or ckpt, *checkpoint_refs(ctx)]))
        hellaswag = ctx.state.data.get("hellaswag_dataset")  # scripts/chain/hellaswag.py, made before session 1
        settings = {"progress": False, "run_name": cfg.name, **cfg.train_settings, "data_dir": data_dir,
                    "out_dir": "{working}/train", **cfg.session_clock(limit_s or cfg.session_limit_s, train_s),
                    "wandb_run_id": self.wandb_run_id(), **hellaswag_settings(ctx, hellaswag)}
        if stop_after_steps:  # the user's train.stop_after_steps, where lower, still holds
            settings["stop_after_steps"] = min(settings.get("stop_after_steps") or stop_after_steps, stop_after_steps)
        if attention:
            settings["attention"] = attention
        return build_kernel("train", ctx.workdir / "build" / "train", user=ctx.client.user, slug=cfg.slug("train"),
                            settings=settings, kernel_type=cfg.kernel_type, accelerator=cfg.accelerator,
                            internet=True, dataset_sources=ckpts + datasets + ([hellaswag] if hellaswag else []),
                            kernel_sources=kernels,
                            checkpoint_dataset={"dataset": ckpt, "publish_to": publish_ref or ckpt,
                                                "resume_setting": "resume_from", "publish": True,
                                                "title": f"{cfg.name} checkpoints", "expect_step": expect_step,
                                                "expect_version": expect_version, "delete_old_versions": delete_old,
                                                "verify_s": publish_verify_s(cfg.train.config),
                                                "publish_s": cfg.publish_margin_s,
                                                "midway_s": cfg.midway_publish_s(limit_s or cfg.session_limit_s)
                                                if midway else 0.0,
                                                "disk": session_disk(cfg),  # checked against the free disk
                                                # a session waits for its version by the chain's own polling
                                                "poll_s": [cfg.poll_initial_s, cfg.poll_max_s]},
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

    def after_session(self, ref: str, sess: dict, ckpt_ref: str) -> tuple[int, int, dict]:
        """The session's log, metrics and plot; the newest proven checkpoint after it: the version it left in the
        checkpoint dataset it published to, read back from exactly that version (published from its output where
        it could not publish it, or its publish never appeared), else the one it resumed from (`ckpt_ref`): (version,
        step, what to record, `ckpt_ref_after` naming that dataset)."""
        ctx = self.ctx
        record, info = self.fetch_results(ref, sess)
        resumed, target = sess.get("ckpt_version", 0), sess.get("publish_ref") or ckpt_ref
        # Never deleting the versions of the checkpoint the session resumed from (a state from before the two
        # datasets publishes where it resumed from)
        delete_old = sess.get("delete_old", False) and (target != ckpt_ref or not sess.get("step_before"))
        before = sess.get("publish_version", resumed) if target != ckpt_ref else resumed
        version = self.session_version(target, before, record)
        # Never trusted short: a version lacking a file of its checkpoint (a dropped upload) is published again from
        # the output, or given up for the newest whole one, in one line.
        short = version_problem(ctx, target, version, record.get("stable_step") is not None) \
            if version > before else None
        step = dataset_step(ctx, target, version) if version > before or target == ckpt_ref else sess["step_before"]
        out_step, start = record.get("step") or 0, record.get("start_step")
        # The session saved a checkpoint the dataset lacks (newer, or --extend's, below the step it saw): publish it.
        extended = start is not None and start < out_step and version == before and start < step
        deleted = record.get("deleted_old_versions", False)  # only once a version was proven (the session's own)
        # Where the dataset published to holds nothing new, the one the session resumed from holds the newest.
        after = (target, version, step) if version > before or target == ckpt_ref else \
            (ckpt_ref, resumed, sess["step_before"])
        if short or out_step > step or extended:
            reason = f"version {version} {short}" if short else record.get("reason") or (
                "its own publish never appeared" if record.get("published") else "the session did not publish it")
            new = publish_from_output(ctx, ref, sess["version"], target, out_step, reason, version, delete_old,
                                      resumed=(ckpt_ref, resumed))
            if new:
                info["published_by"], after, deleted = "chain", (target, new, out_step), delete_old
            elif short:
                after = self.lost_short_version(target, before, version, short, out_step or step,
                                                (ckpt_ref, resumed, sess["step_before"]))
        elif record.get("published") and version > before:
            info["published_by"] = "session"
        holder, version, step = after
        if holder == target and version > before:
            # Older versions count as live unless a proven version's publish deleted them: the next deleting
            # publish then comes early rather than late.
            note_version(ctx, version, deleted, ref=target)
            if start is not None and start < sess["step_before"]:
                info["start_step"] = start  # --extend: it trained on from the stable phase, below the dataset's step
        info["ckpt_version_after"], info["ckpt_ref_after"] = version, holder
        return version, max(step, 0), info

    def lost_short_version(self, target: str, before: int, short: int, problem: str, step: int,
                           resumed: tuple[str, int, int]) -> tuple[str, int, int]:
        """Version `short` of `target` is not whole and the session's output holds no copy of its checkpoint:
        (`target`, the newest whole version after `before`, its step), else `resumed` ((dataset, version, step) the
        session resumed from), and one line saying what is lost."""
        ctx, found = self.ctx, None
        for number in range(short - 1, before, -1):  # a midway publish, or the session's first, proven version
            try:
                if version_problem(ctx, target, number) is None:
                    found = (target, number, dataset_step(ctx, target, number))
                    break
            except ApiFailure:  # deleted
                continue
        ref, number, held = found or resumed
        ctx.log(f"  warning: version {short} of {target} {problem}, and the session's output holds no whole copy: "
                f"step {step} is lost; the next session resumes from version {number} of {ref} (step {held})")
        return found or resumed

    def fetch_results(self, ref: str, sess: dict) -> tuple[dict, dict]:
        """The session's publish record, metrics and plot from its output: (publish record, what to record)."""
        ctx = self.ctx
        dest = ctx.workdir / "sessions" / f"train-{sess['n']:02d}"
        wanted = (PUBLISH_RECORD, FACTS_FILE, "train/metrics.jsonl", "train/loss.png")
        # and a profile's trace (train.profile_steps: the smoke's sessions), at any depth under train/profile/
        ctx.client.download_output(ref, dest, pattern="^(" + "|".join(map(re.escape, wanted)) + r"|train/profile/.+)$",
                                   version=sess["version"])
        for name in ("metrics.jsonl", "loss.png"):
            if (dest / "train" / name).exists():
                shutil.copyfile(dest / "train" / name, ctx.workdir / name)
        record = json.loads((dest / PUBLISH_RECORD).read_text()) if (dest / PUBLISH_RECORD).exists() else {}
        metrics = dest / "train" / "metrics.jsonl"
        error = log_error_line(dest, ref)
        probes = probe_results(dest / FACTS_FILE, error)
        # What the session measured of what the plan assumes (uploads, time to ready, clock, token, disk), kept
        # beside its tokens/s (scripts/chain/measured.py)
        facts = keep_session_facts(dest / FACTS_FILE, self.cfg.name)
        return record, {"logs": str(dest), **(session_measurements(metrics) if metrics.exists() else {}),
                        **({"error": error} if error else {}), **({PROBES_FACT: probes} if probes else {}),
                        **({"measured": facts} if facts else {})}

    def session_version(self, ckpt_ref: str, before: int, record: dict) -> int:
        """The checkpoint version after the session: the newer one it made, once ready, else `before`. Right after
        a publish Kaggle may still show `before`, so a session that says it published is waited for; a publish
        that never appears is a warning here (the chain publishes from the output instead)."""
        client = self.ctx.client
        number, _ = client.dataset_version(ckpt_ref)
        if number <= before and not record.get("published"):
            return before
        try:
            return client.wait_dataset_version(ckpt_ref, before)
        except VersionMissing as err:
            if number > before:  # a version appeared but never became ready
                raise
            self.ctx.log(f"  warning: the session's publish of step {record.get('step')} reported success, but "
                         f"{err} (a create over the private-dataset quota is answered so: kaggle-cli issue 284)")
            return before

    def report(self, sess: dict, before: int, after: int, status: str, message: str, secs: float) -> None:
        """A few lines per session: steps, loss, tokens/s, sessions and quota left, where the logs are."""
        from shared.train.metrics import read_metrics
        from shared.train.projection import summary_line
        from shared.train.reference import summary_line as reference_line
        from shared.train.throughput import run_throughput

        ctx, cfg = self.ctx, self.cfg
        metrics = ctx.workdir / "metrics.jsonl"
        records = read_metrics(metrics) if metrics.exists() else []
        losses = [r for r in records if r.get("loss") is not None and before < r.get("step", 0) <= after]
        measured = run_throughput(records, before, after)
        loss = f"loss {losses[-1]['loss']:.4f}" if losses else "no loss logged"
        speed = measured.describe() if measured else "tokens/s n/a"
        left = sessions_left(cfg, after, ctx.state.data["train_sessions"]) if after < cfg.total_steps else 0
        extended = " (--extend: from where the stable phase ended)" if before < sess["step_before"] else ""
        ctx.log(f"  session {sess['n']} {status.lower()} in {secs:.0f}s: step {before}{extended} -> {after} of "
                f"{cfg.total_steps}, {loss}, {speed}" + (f" ({message})" if message else ""))
        if sess.get("error"):
            ctx.log(f"  its last error line: {sess['error']}")
        for record in records:  # the trainer's projection where the stable phase ended (shared/train/projection.py)
            if record.get("event") == "projection" and before <= record["step"] <= after:
                ctx.log(f"  {summary_line(record)}")
        held = [r for r in records if r.get("event") == "reference" and before < r["step"] <= after]
        if held:  # the newest eval held against a published run (shared/train/reference.py)
            ctx.log(f"  {reference_line(held[-1])}")
        quota = None
        try:
            quota = self.quota_left_s()
        except ApiFailure:
            pass
        quota_text = (f", {MACHINE_SHAPES[cfg.accelerator].upper()} quota left {quota[0] / 3600:.2f} h "
                      f"(~{int(quota[0] // cfg.session_limit_s)} sessions)") if quota else ""
        ctx.log(f"  ~{left} more session(s){quota_text}")
        ctx.log(f"  logs: {sess.get('logs') or ''}  metrics: {metrics}  plot: {ctx.workdir / 'loss.png'}")


def extend_start(ctx: StageContext, ref: str, version: int, cfg: ChainConfig) -> int:
    """The step a train.extend session resumes from, as its trainer will choose it (shared/train/trainer.py
    `resume_point`): the newer of version `version`'s checkpoint and the stable-phase one it carries that agrees
    with the longer schedule. Neither agreeing is one line here, before any session is pushed."""
    from shared.runtime.optim import same_schedule_until, saved_schedule

    train = cfg.train.config
    seen = []
    for prefix in ("", STABLE_PREFIX):
        state_file = ctx.workdir / "dataset-probe" / f"{prefix}{STATE_FILE}"
        if download_dataset_file(ctx, ref, version, prefix + STATE_FILE, state_file):
            was, step = saved_schedule(train, json.loads(state_file.read_text()))
            seen.append((step, was, same_schedule_until(was, train, step)))
    agreeing = [step for step, _, agrees in seen if agrees]
    if not agreeing:
        found = "; ".join(f"step {step} of a {was.lr_schedule.total_steps}-step {was.lr_schedule.schedule} schedule"
                          for step, was, _ in seen)
        raise UserError(f"train.extend: no checkpoint in version {version} of {ref} agrees with total_steps "
                        f"{cfg.total_steps} ({found or 'none found'}): its decay must start after the stable phase "
                        "the run kept (docs/recipe.md section 6)")
    return max(agreeing)


def start_of(sess: dict) -> int:
    """The step a session trained on from: where the dataset stood, or (--extend) where the stable phase ended."""
    return sess.get("start_step", sess.get("step_before", 0))


def _progressed(sessions: list) -> list:
    return [s for s in sessions if s.get("ended") and s.get("step_after", 0) > start_of(s)]


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
    per = sum(s["step_after"] - start_of(s) for s in done) / len(done)
    return max(1, math.ceil((cfg.total_steps - step) / per))


def _trailing_failures(sessions: list):
    for s in reversed(sessions):
        if not s.get("ended") or s.get("lengthened") or s.get("bound_to_repeat"):
            continue
        if s.get("step_after", 0) > start_of(s):
            return
        yield s
