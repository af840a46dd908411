"""`scripts/chain_sessions.py --plan`: what a chain config will do, before anything is pushed and without
credentials: each stage and its machine, the tokens, the steps and the sessions they take at a stated tokens/s,
the TPU hours against the weekly quota, the checkpoint's size and where it is kept, and the margins.

The config was checked on loading (scripts/chain/config.py); the plan also builds every kernel the chain would
push, into a scratch folder, so each kernel's settings pass the same checks its session runs at its start.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from scripts.chain.account import list_private_datasets, read_quota
from scripts.chain.ceilings import ceilings_text, compiled_rates, head_dim_aware, planning_ceiling
from scripts.chain.checkpoint_room import (
    PUBLISH_UPLOADS,
    checkpoints_in_temp,
    keeps_stable,
    publish_verify_s,
    upload_s,
)
from scripts.chain.config import ChainConfig
from scripts.chain.limits import (
    ASSUMED_UPLOAD_BYTES_PER_S,
    MACHINE_SHAPES,
    OUTPUT_LIMIT_BYTES,
    RETIRED_SHAPES,
    session_devices,
)
from scripts.chain.measured import publish_line
from scripts.chain.sizing import MIN_STEPS, training_s
from scripts.chain.storage import disk_line, room_line, storage_line, storage_plan
from shared.config import AUTO, HELLASWAG_VALIDATION_EXAMPLES, TrainConfig
from shared.errors import UserError
from shared.model.attention import FLASH, SDPA, SETTING_OF, SPLASH, candidates, untiled_kernels
from shared.train_sections import EvalSettings

REPO = Path(__file__).resolve().parents[2]
# What --smoke measured, one record per run (newest last); the plan counts sessions with the newest that matches.
MEASURED_THROUGHPUT = REPO / "runs" / "measured-throughput.json"
# The MFU a plan assumes before anything is measured, where the TPU compiler is off: the middle of
# docs/tpu-throughput.md's 25-35% estimate for torch_xla GPT-2 on a v5e-8 (no published TPU figure exists to take
# instead). It ignores which kernel a session will run.
PLAN_MFU = 0.30
# The TPU generation a shape runs on (shared/tpu.py TPU_GENERATIONS has its peak).
SHAPE_GENERATION = {"TpuV5E8": "v5e", "TpuV6E8": "v6e"}
# Kaggle's weekly quotas as Kaggle's pages state them; not verified from a primary source (docs/kaggle-api.md);
# with credentials the plan reads the account's own quota instead.
WEEKLY_QUOTA_S = {"tpu": 20 * 3600.0, "gpu": 30 * 3600.0}
# HellaSwag's validation split: examples x 4 endings, ~ tokens a row (context + ending), for the eval estimate.
HELLASWAG_ROWS, HELLASWAG_TOKENS_PER_ROW = HELLASWAG_VALIDATION_EXAMPLES * 4, 100

# The attention kernels (shared/model/attention.py) as the plan names their steps, and as scripts/tpu_compile.py
# names them.
STEP_NAMES = {SPLASH: "splash", FLASH: "flash", SDPA: "SDPA"}  # each attention kernel's step, as the plan says it


@dataclasses.dataclass
class Throughput:
    tokens_per_s: float | None  # None: nothing to plan sessions with
    source: str
    sdpa_tokens_per_s: float | None = None  # the estimate where a session falls back to SDPA (compiled)


def running_shape(shape: str) -> str:
    """The shape a session really runs on: Kaggle substitutes a retired one."""
    return RETIRED_SHAPES.get(shape, shape)


def measured_throughput(shape: str, train: TrainConfig, path: Path = MEASURED_THROUGHPUT) -> dict | None:
    """The newest --smoke measurement on this shape, preset and sequence length, if any."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    matching = [r for r in records if r.get("accelerator") == shape and r.get("preset") == train.model.preset
                and r.get("seq_len") == train.model.shape.block_size and r.get("tokens_per_s")]
    return matching[-1] if matching else None


def train_throughput(cfg: ChainConfig, train: TrainConfig, measured_path: Path = MEASURED_THROUGHPUT,
                     compiled: dict | None = None) -> Throughput:
    """Training tokens/s to plan with, and where the figure comes from. `compiled`: the TPU compiler's report of
    the step a session tries first (`compiled_fit`), whose ceiling the estimate is a share of."""
    shape = running_shape(cfg.accelerator)
    if cfg.plan_tokens_per_s:
        return Throughput(cfg.plan_tokens_per_s, "plan_tokens_per_s in the config")
    record = measured_throughput(shape, train, measured_path)
    if record:
        return Throughput(float(record["tokens_per_s"]),
                          f"measured by --smoke ({record.get('chain', '?')}, {record.get('measured_at', '?')}, "
                          f"MFU {record.get('mfu') or 0:.1%})")
    generation = SHAPE_GENERATION.get(shape)
    if not generation:
        return Throughput(None, f"no estimate for {shape or 'CPU'}: measure it with --smoke, or set "
                                "plan_tokens_per_s in the config")
    from shared.tpu import TPU_GENERATIONS  # standard library only at import

    gen = TPU_GENERATIONS[generation]
    board = gen.peak_bf16_per_device * session_devices(shape)
    peaks = f"{session_devices(shape)} x {gen.peak_bf16_per_device / 1e12:g} TFLOP/s bf16"
    if compiled and compiled.get("fits") and planning_ceiling(compiled):
        rate, sdpa, text = compiled_rates(compiled, board, train.model.shape, STEP_NAMES, f"{peaks} ({generation})")
        return Throughput(rate, text, sdpa)
    rate = board * PLAN_MFU / train.model.shape.flops_per_token()
    return Throughput(rate, f"estimate: {PLAN_MFU:.0%} MFU of {peaks} ({generation}; docs/tpu-throughput.md "
                            "section 7); not measured: run --smoke first")


def planned_train(cfg: ChainConfig) -> tuple[TrainConfig, str]:
    """The train settings a session will run with, `micro_batch: auto` resolved as the session would on the
    chain's machine (with the first attention kernel it tries there, shared/model/attention.py, passing its
    probe), and a note saying so, with what a fallback kernel would take where it differs ('' if not auto)."""
    train = cfg.train.config
    if train.step.micro_batch != AUTO:
        return train, ""
    from shared.tpu import micro_batch_for  # standard library only at import

    generation = SHAPE_GENERATION.get(running_shape(cfg.accelerator))
    devices = session_devices(cfg.accelerator, train.step.backend)
    first, *fallbacks = candidates(generation, train.model.shape.block_size, train.step.attention)
    chosen = micro_batch_for(train, generation, first, devices)
    note = f"auto: {chosen} on {generation or 'no TPU'} with {first} attention"
    for attention in fallbacks:
        fallback = micro_batch_for(train, generation, attention, devices)
        if fallback != chosen:
            note += f", {fallback} if it falls back to {STEP_NAMES[attention]}"
    return train.replace(micro_batch=chosen), note


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _tokens(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n:,.0f}"


def make_plan(cfg: ChainConfig, quota: tuple[float, float, str] | None = None,
              measured_path: Path = MEASURED_THROUGHPUT, compiled: dict | None = None) -> dict:
    """The plan's figures (the printed lines come from these; tests assert them). `compiled`: the TPU compiler's
    report of the step (`compiled_fit`), whose ceiling the tokens/s estimate is a share of where nothing is
    measured."""
    train, _ = planned_train(cfg)
    model = train.model.shape
    tok = cfg.tokenize.config
    parts = cfg.tokenize.parts
    kind = MACHINE_SHAPES.get(cfg.accelerator)
    train_tokens = cfg.total_steps * train.step.total_batch_tokens
    made_tokens = tok.tokens_in_parts(parts)
    val_tokens = tok.shard_size if parts else 0  # part 0's first shard is the validation shard
    speed = train_throughput(cfg, train, measured_path, compiled)
    plan = {"train_tokens": train_tokens, "tokenized_tokens": made_tokens, "validation_tokens": val_tokens,
            "parts": parts, "tokens_per_part": tok.tokens_per_part, "tokens_per_s": speed.tokens_per_s,
            "tokens_per_s_source": speed.source, "sdpa_tokens_per_s": speed.sdpa_tokens_per_s,
            "kind": kind, "devices": session_devices(
                cfg.accelerator, train.step.backend), "time_budget_s": cfg.time_budget,
            "checkpoint_bytes": model.checkpoint_bytes(), "num_params": model.num_params()}
    # Periodic evals (validation loss every eval_every steps, HellaSwag where a file is given every
    # hellaswag_every) cost forward passes, a third of a training token's FLOPs each.
    eval_share = 0.0
    if train.evals.eval_every:
        val_tokens = train.evals.eval_batches * train.step.micro_batch * model.block_size
        eval_share = val_tokens / 3 / (train.evals.eval_every * train.step.total_batch_tokens)
        if train.evals.hellaswag_file or cfg.hellaswag:
            hs_tokens = (train.evals.hellaswag_examples * 4 or HELLASWAG_ROWS) * HELLASWAG_TOKENS_PER_ROW
            eval_share += hs_tokens / 3 / (hellaswag_every_steps(train.evals) * train.step.total_batch_tokens)
    plan["eval_share"] = eval_share
    if speed.tokens_per_s:
        train_s = train_tokens / speed.tokens_per_s * (1 + eval_share)
        # A session trains its budget less its checkpoint writes (start-up is outside the budget, in its margin).
        session_s = training_s(cfg.time_budget, train, speed.tokens_per_s, eval_share)
        sessions = max(1, math.ceil(train_s / session_s))
        if cfg.max_train_sessions:
            sessions = min(sessions, cfg.max_train_sessions)
        overhead_s = sessions * (cfg.startup_margin_s + cfg.publish_margin_s)
        plan.update(train_seconds=train_s, sessions=sessions, session_seconds=session_s,
                    session_tokens=session_s * speed.tokens_per_s / (1 + eval_share),
                    train_quota_s=min(train_s * cfg.time_budget / session_s, sessions * cfg.time_budget) + overhead_s)
        plan["eval_quota_s"] = _eval_seconds(cfg, speed.tokens_per_s) if cfg.eval.enabled else 0.0
        eval_kind = MACHINE_SHAPES.get(cfg.eval.accelerator)
        plan["quota_s"] = plan["train_quota_s"] + (plan["eval_quota_s"] if eval_kind == kind else 0.0)
    weekly = quota[1] if quota else WEEKLY_QUOTA_S.get(kind) if kind else None
    plan["weekly_quota_s"], plan["quota_left_s"] = weekly, quota[0] if quota else None
    if weekly and plan.get("sessions"):
        per_week = int(weekly // cfg.session_limit_s)  # a session starts only with a whole session's quota left
        plan["sessions_per_week"] = per_week
        # This week holds what is left of its quota; later weeks the whole allowance.
        this_week = int(plan["quota_left_s"] // cfg.session_limit_s) if quota else per_week
        plan["sessions_this_week"] = this_week
        later = max(0, plan["sessions"] - this_week)
        plan["weeks"] = (1 + math.ceil(later / per_week) if later else 1) if per_week else None
    return plan


def hellaswag_every_steps(evals: EvalSettings) -> int:
    """About how often in-training HellaSwag runs: at the first eval past each multiple of hellaswag_every, so never
    more often than the evals (0: at every eval)."""
    return max(evals.hellaswag_every, evals.eval_every)


def _eval_seconds(cfg: ChainConfig, train_tokens_per_s: float) -> float:
    """An eval session: start-up, then forward passes at three times the training rate (forward only)."""
    ev = cfg.eval.config
    rows = 0 if ev.hellaswag == "off" else ev.hellaswag_examples * 4 or HELLASWAG_ROWS
    forward_tokens = ev.val_tokens + rows * HELLASWAG_TOKENS_PER_ROW
    return cfg.startup_margin_s + forward_tokens / (3 * train_tokens_per_s)


def plan_lines(cfg: ChainConfig, plan: dict, source: str = "") -> list[str]:
    """The plan as the lines --plan prints."""
    train, auto_note = planned_train(cfg)
    model, user = train.model.shape, cfg.user or "<you>"
    shape = cfg.accelerator or "CPU"
    lines = [f"plan for chain {cfg.name}{f' ({source})' if source else ''}: nothing is pushed", ""]
    tok_shape = cfg.tokenize.accelerator or "CPU"
    if plan["parts"]:
        tok = cfg.tokenize.config
        corpus = tok.data_files or f"{tok.dataset} {tok.config}".strip()
        lines.append(f"tokenize  {tok_shape}, internet on: {plan['parts']} part(s) x {_tokens(tok.tokens_per_part)} "
                     f"tokens = {_tokens(plan['tokenized_tokens'])} tokens of {corpus}, shards of "
                     f"{_tokens(tok.shard_size)} ({_gb(2 * tok.tokens_per_part)} a part, {tok.max_output_gb:g} GB "
                     "allowed; notebook outputs, not datasets, so not counted in the storage line's quota; CPU "
                     "sessions, no accelerator quota)")
        if plan["tokenized_tokens"] < plan["parts"] * tok.tokens_per_part:
            lines.append(f"          the corpus holds about {_tokens(plan['tokenized_tokens'])} tokens: the last part "
                         "ends where it does")
    for ref in list(cfg.token_datasets) + list(cfg.token_kernels):
        lines.append(f"tokens    {ref} (existing; not counted below)")
    retired = f" (retired: runs on {running_shape(shape)})" if shape in RETIRED_SHAPES else ""
    lines.append(f"train     {shape}{retired}, {plan['devices']} devices: {train.model.preset} "
                 f"({plan['num_params'] / 1e6:.1f}M params, T={model.block_size}), {cfg.total_steps:,} steps x "
                 f"{train.step.total_batch_tokens:,} tokens = {_tokens(plan['train_tokens'])} tokens; micro-batch "
                 f"{train.step.micro_batch}{auto_note and f' ({auto_note})'} x {train.grad_accum_steps} accumulation; "
                 f"{train.optim.optimizer} + {train.lr_schedule.schedule}")
    if train.evals.eval_every and (cfg.hellaswag or train.evals.hellaswag_file):
        hs_every = hellaswag_every_steps(train.evals)
        examples = (f"a seeded sample of {train.evals.hellaswag_examples}" if train.evals.hellaswag_examples
                    else f"all {HELLASWAG_VALIDATION_EXAMPLES:,}")
        lines.append(f"          every {train.evals.eval_every} steps: validation loss; every {hs_every}, at the "
                     f"stable phase's end and at the last step: HellaSwag on {examples} examples "
                     f"({cfg.hellaswag or train.evals.hellaswag_file}), acc_norm with its standard error, plotted "
                     "beside the loss")
    if train.lr_schedule.extend:
        lines.append("          train.extend: a finished or decaying run trains on from the stable-phase checkpoint "
                     "its dataset carries (the chain names the step before pushing); the steps and hours here "
                     "count the whole run from step 0")
    if cfg.eval.enabled:
        ev = cfg.eval.config
        lines.append(f"eval      {cfg.eval.accelerator or 'CPU'}: validation loss on "
                     f"{_tokens(ev.val_tokens) if ev.val_tokens else 'all'} tokens, HellaSwag {ev.hellaswag}, "
                     f"samples, HF export {'on' if ev.export else 'off'}; a session of at most "
                 f"{_hours(cfg.eval_session_limit_s)}")
    lines.append("")
    rate = plan["tokens_per_s"]
    lines.append(f"throughput  {f'{rate:,.0f} tokens/s' if rate else 'unknown'} on {running_shape(shape)}: "
                 f"{plan['tokens_per_s_source']}")
    if cfg.session_train_s:
        lines.append(f"sessions    each its start-up as measured (~{cfg.startup_margin_s:g} s) + "
                     f"{cfg.session_train_s:g} s of training (session_train_s) from the end of its first step + "
                     f"{cfg.publish_margin_s:g} s to publish, at most {_hours(cfg.session_limit_s)}; the first "
                     f"{MIN_STEPS} steps")
    else:
        lines.append(f"sessions    each {_hours(cfg.session_limit_s)}: {_hours(cfg.time_budget)} of training after "
                     f"{cfg.startup_margin_s:g} s start-up and {cfg.publish_margin_s:g} s publish margins")
    if plan.get("sessions"):
        capped = " (max_train_sessions)" if cfg.max_train_sessions and plan["sessions"] == cfg.max_train_sessions \
            else ""
        lines.append(f"            {_tokens(plan['train_tokens'])} tokens take {_hours(plan['train_seconds'])} of "
                     f"training ({_tokens(plan['session_tokens'])} a session, in its {_hours(plan['session_seconds'])}"
                     f" once its checkpoint writes are out): {plan['sessions']} session(s)"
                     f"{capped}; evals (validation, HellaSwag) add {plan['eval_share']:.1%}")
        kind = (plan["kind"] or "cpu").upper()
        lines.append(f"{kind} hours   ~{_hours(plan['quota_s'])}: training {_hours(plan['train_quota_s'])} with "
                     f"margins, eval ~{_hours(plan['eval_quota_s'])}")
    if plan.get("weekly_quota_s"):
        left = (f"{_hours(plan['quota_left_s'])} left this week of {_hours(plan['weekly_quota_s'])} (your account)"
                if plan["quota_left_s"] is not None else
                f"{_hours(plan['weekly_quota_s'])} a week (Kaggle's stated quota, not verified; run with "
                "credentials to read yours)")
        weeks = plan.get("weeks")
        now = (f"{plan['sessions_this_week']} this week, " if plan["quota_left_s"] is not None
               and "sessions_this_week" in plan else "")
        lines.append(f"quota       {left}: {now}{plan.get('sessions_per_week', 0)} session(s) a week"
                     + (f" -> {weeks} week(s)" if weeks else ""))
    size = plan["checkpoint_bytes"]
    ckpt_dir = train.session.checkpoint_dir or "{working}/train/checkpoints"
    keep = train.session.keep_checkpoints
    others = plan.get("private_datasets")  # the user's other private datasets, where read: they share the quota
    storage = storage_plan(cfg, taken=sum((others or {}).values()))
    versions = f"at most {storage.keep} versions kept in each"
    if checkpoints_in_temp(train):
        versions += (f"; with no copy in the output, a session waits up to {publish_verify_s(train):.0f} s for "
                     "its version and publishes again if it failed")
    midway_s = cfg.midway_publish_s(cfg.session_limit_s) if storage.midway else 0.0
    if midway_s:
        versions += (f"; each session also publishes its first checkpoint past {_hours(midway_s)} in, while it "
                     "trains, for a kill before its end")
    stable = (", and from the end of the stable phase the checkpoint kept there beside it (train.extend trains on "
              f"from it): {_gb(2 * size)} a version") if keeps_stable(train) else ""
    room = (f"not in the session's output, which holds {OUTPUT_LIMIT_BYTES / 1e9:g} GB"
            if checkpoints_in_temp(train) else
            f"{_gb((keep + 1) * size)} while one is written; the output holds {OUTPUT_LIMIT_BYTES / 1e9:g} GB")
    lines.append(f"checkpoint  {_gb(size)} (fp32 weights + AdamW moments), {keep} kept in {ckpt_dir} "
                 f"({room}), published to datasets {user}/{cfg.slug('checkpoints')} and "
                 f"{user}/{cfg.slug('checkpoints-b')} in turn "
                 f"({versions}{stable})")
    lines.append(f"storage     {storage_line(storage)}")
    lines.append(f"quota room  {room_line(cfg, storage, others, (), plan.get('private_why', ''))}")
    lines.append(f"disk        {disk_line(cfg, bool(midway_s))}")
    lines.append("")
    lines += [f"margin      {line}" for line in margins(cfg, plan)]
    lines += [f"warning     {line}" for line in warnings(cfg, plan, train)]
    return lines


def margins(cfg: ChainConfig, plan: dict) -> list[str]:
    out = []
    if plan["parts"]:
        need = plan["train_tokens"] + plan["validation_tokens"]
        spare = plan["tokenized_tokens"] - need
        out.append(f"tokens: {_tokens(plan['tokenized_tokens'])} tokenized for {_tokens(plan['train_tokens'])} "
                   f"trained + {_tokens(plan['validation_tokens'])} validation: {spare / need:+.1%}")
    uploads_s = upload_s(cfg.train.config, plan["checkpoint_bytes"])
    out.append(f"session: {cfg.startup_margin_s:g} s for start-up (imports, data, compile); "
               f"{cfg.publish_margin_s:g} s to publish, the upload alone ~{uploads_s:.0f} s at an assumed "
               f"{ASSUMED_UPLOAD_BYTES_PER_S / 1e6:g} MB/s, once: a deleting publish no longer uploads it again "
               f"(two checkpoint datasets in turn), ~{uploads_s:.0f} s less than with one")
    out.append(f"publish: {publish_line(PUBLISH_UPLOADS, cfg.version_bytes, cfg.publish_margin_s)}")
    if plan.get("quota_s") and plan.get("weekly_quota_s"):
        weeks = plan.get("weeks") or 1
        now = plan["weekly_quota_s"] if plan["quota_left_s"] is None else plan["quota_left_s"]
        out.append(f"quota: {_hours(now + plan['weekly_quota_s'] * (weeks - 1) - plan['quota_s'])} spare over "
                   f"{weeks} week(s)" + (" (this week's from what is left of it)" if now != plan["weekly_quota_s"]
                                         else ""))
    return out


def warnings(cfg: ChainConfig, plan: dict, train: TrainConfig) -> list[str]:
    out = []
    if plan["parts"] and plan["tokenized_tokens"] < plan["train_tokens"] + plan["validation_tokens"]:
        passes = plan["train_tokens"] / max(1, plan["tokenized_tokens"] - plan["validation_tokens"])
        out.append(f"the parts make {_tokens(plan['tokenized_tokens'])} tokens but training reads "
                   f"{_tokens(plan['train_tokens'])}: the run repeats data ({passes:.2f} passes over the training "
                   "shards)")
    if train.lr_schedule.warmup_steps >= cfg.total_steps:
        out.append(f"warmup_steps {train.lr_schedule.warmup_steps} >= total_steps {cfg.total_steps}: the learning "
                   "rate never reaches its peak")
    if plan["tokens_per_s"] is None:
        out.append("no tokens/s for this machine: sessions and quota are not estimated")
    if plan.get("sessions_this_week") == 0 and plan.get("sessions_per_week"):
        out.append(f"{_hours(plan['quota_left_s'])} of quota left this week is less than one "
                   f"{_hours(cfg.session_limit_s)} session: the chain starts nothing until the weekly reset")
    if plan.get("weeks") and plan["weeks"] > 1:
        out.append(f"{plan['weeks']} weeks of quota: the chain stops when a week's quota runs low and continues "
                   "when you run it again after the reset")
    return out


def check_builds(cfg: ChainConfig) -> int:
    """Build every kernel the chain would push into a scratch folder: each kernel's final settings pass the
    checks its session runs. Returns how many kernels were built."""
    from scripts.chain.chain import Chain

    with tempfile.TemporaryDirectory(prefix="gpt2k-plan-") as scratch:
        chain = Chain(dataclasses.replace(cfg, user=cfg.user or "plan-user"), scratch, log=lambda _: None)
        if cfg.hellaswag:  # where the chain will have uploaded it
            from scripts.chain.hellaswag import hellaswag_ref

            chain.state.data["hellaswag_dataset"] = hellaswag_ref(chain.ctx)
        parts = cfg.tokenize.parts
        for part in range(parts):
            chain.tokenize.build(part, "plan")
        chain.train.build("plan", 0)
        if cfg.eval.enabled:
            chain.eval.build("plan")
        return parts + 1 + int(cfg.eval.enabled)


def check_arithmetic_fit(cfg: ChainConfig, generation: str) -> None:
    """One UserError naming the fix where even one sequence per chip cannot fit by shared/tpu.py's arithmetic (the
    compiler, where installed, is the finer check)."""
    from shared.tpu import activation_checkpointing_on, smallest_step_bytes

    train, _ = planned_train(cfg)
    model = train.model.shape
    checkpointing = activation_checkpointing_on(train.step.activation_checkpointing, model.n_layer, generation)
    devices = session_devices(cfg.accelerator, train.step.backend)
    attention = candidates(generation, model.block_size, train.step.attention)[0]  # the kernel a session tries first
    need = smallest_step_bytes(generation, attention, model, model.block_size, devices, checkpointing, train.step.fsdp)
    if need is not None and need[0] > need[1]:
        raise UserError(f"the train step cannot fit a {generation} chip's HBM: {need[0] / 2**30:.1f} GiB a chip at "
                        f"one sequence per micro-step ({train.model.preset}{', fsdp' if train.step.fsdp else ''}), "
                        "over the "
                        f"{need[1] / 2**30:.1f} GiB its buffers may use (arithmetic: shared/tpu.py); set "
                        "train.fsdp true" + ("" if checkpointing else ", or train.activation_checkpointing \"on\""))


def compiled_fit(cfg: ChainConfig, log=print) -> tuple[dict | None, str]:
    """The chain's train step compiled for its TPU board by libtpu (scripts/tpu_compile_step.py; cached by settings and
    versions), and one line on it: the step compiled (the first kernel a session tries at this sequence length,
    shared/model/attention.py), HBM per chip, the loop's all-reduces, the MFU ceiling, then what each fallback a
    session takes where a probe fails needs. A step that does not fit is one UserError naming the fix; a step that
    does not compile is a clause of the line (the primary's: HBM checked by arithmetic instead). Without a TPU board,
    or without the compiler, (None, why)."""
    from scripts.tpu_compile_step import KAGGLE_TPUS, TPUS, compile_step, compiler_python

    generation = SHAPE_GENERATION.get(running_shape(cfg.accelerator))
    tpu = next((name for name in KAGGLE_TPUS if TPUS[name]["generation"] == generation), None)
    if tpu is None:
        return None, f"no TPU compiler check on {cfg.accelerator or 'CPU'}"
    if compiler_python() is None:
        why = ("is off (TPU_COMPILER_PYTHON=off)" if os.environ.get("TPU_COMPILER_PYTHON") == "off" else
               "is not installed (bash scripts/setup.sh makes .venv-tpu)")
        check_arithmetic_fit(cfg, generation)
        return None, f"the TPU compiler {why}: HBM checked by arithmetic only"
    settings, train = cfg.train_settings, cfg.train.config
    seq_len = train.model.shape.block_size
    tried = candidates(generation, seq_len, train.step.attention)
    untiled = untiled_kernels(generation, seq_len, train.step.attention) if tried == (SDPA,) else []
    why_sdpa = f", what a session runs at T={seq_len}: the {' and '.join(untiled)} kernels' blocks do not tile it" \
        if untiled else ""
    try:
        report = compile_step(settings, tpu, log, attention=SETTING_OF[tried[0]])
    except Exception as err:  # the tool's failure, not the step's: the plan goes on with the arithmetic
        check_arithmetic_fit(cfg, generation)
        return None, (f"{tpu}: the {STEP_NAMES[tried[0]]} step did not compile ({_one_line(err)}): HBM checked "
                      "by arithmetic only")
    hbm = f"{report['peak_bytes'] / 2**30:.1f} GiB of {report['hbm_bytes'] / 2**30:.0f} GiB"
    step = STEP_NAMES.get(report["attention"], report["attention"])
    if not report["fits"]:
        raise UserError(f"the train step does not fit {tpu}'s HBM: {hbm} per chip (the TPU compiler's figure; "
                        f"{report['preset']}, micro-batch {report['micro_batch']}, the {step} step); lower "
                        "train.micro_batch (or leave it auto), set train.activation_checkpointing \"on\", or set "
                        "train.fsdp true")
    in_loop = [g for g in report["collectives"] if g["where"] == "inside" and g["kind"] == "all-reduce"]
    line = (f"{tpu} by libtpu {report['versions']['libtpu']} (the {step} step{why_sdpa}, micro-batch "
            f"{report['micro_batch']}): HBM per chip {hbm} ({report['free_fraction']:.0%} free); "
            f"all-reduce inside the loop {sum(g['count'] for g in in_loop)}, "
            f"{sum(g['bytes'] for g in in_loop) / 1e6:.1f} MB per micro-step; "
            f"{ceilings_text(report, train.model.shape)}")
    # The steps a session trains with where its probes fail, in the order it tries them.
    report["fallback_reports"] = {}
    for failed, attention in zip(tried, tried[1:], strict=False):
        line += f"; if the {STEP_NAMES[failed]} probe fails, {STEP_NAMES[attention]}"
        try:
            fallback = compile_step(settings, tpu, log, attention=SETTING_OF[attention])
        except Exception as err:  # one clause; the plan goes on
            line += f": did not compile ({_one_line(err)})"
            continue
        report["fallback_reports"][attention] = fallback
        line += (f" at micro-batch {fallback['micro_batch']}: {fallback['peak_bytes'] / 2**30:.1f} GiB" + (
            f", MFU ceiling {fallback['mfu_ceiling']:.1%}" + (
                f" ({planning_ceiling(fallback):.1%} head-dim-aware)" if head_dim_aware(fallback) else "")
            if fallback["fits"] else
            " - does not fit: such a session would stop at its first step (leave train.micro_batch auto)"))
    return report, line


def _one_line(err: BaseException) -> str:
    from shared.errors import describe_error

    return str(err).splitlines()[0][:300] if isinstance(err, UserError) and str(err) else describe_error(err)


def print_plan(cfg: ChainConfig, source: str = "", log=print, with_quota: bool = True,
               measured_path: Path = MEASURED_THROUGHPUT) -> dict:
    built = check_builds(cfg)
    quota, why = read_quota(cfg) if with_quota and MACHINE_SHAPES.get(cfg.accelerator) else (None, "")
    compiled, compiled_line = compiled_fit(cfg, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    plan = make_plan(cfg, quota, measured_path, compiled)
    plan["private_datasets"], plan["private_why"] = list_private_datasets(cfg) if with_quota else (None, "")
    plan["kernels_built"], plan["compiled"] = built, compiled
    lines = plan_lines(cfg, plan, source)
    at = next((i for i, line in enumerate(lines) if line.startswith("throughput")), len(lines))
    lines.insert(at + 1, f"compiled    {compiled_line}")
    for line in lines:
        log(line)
    if why:
        log(f"(quota not read: {why})")
    log(f"{built} kernel(s) built and checked as their sessions will check them; run without --plan to start "
        f"({time.strftime('%Y-%m-%d %H:%M')})")
    return plan
