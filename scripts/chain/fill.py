"""A run sized to the session it has (ChainConfig.fill_session): where --smoke measured this machine's tokens/s,
total_steps becomes what fills that share of one session's time, evals included and checkpoint writes left out
(scripts/chain/sizing.py training_s), up to `fill_passes` passes over the tokens the tokenize parts make (one by
default); and the parts make no more than the run reads: the whole run once where it fits them, else as much as they
hold, read again (never the validation shard: it is its own split). Without a measurement the config's total_steps
stays: a guessed rate would size the run on nothing.

A chain fixes the figure in its state at its first start (Chain.run): a later measurement must not change the
schedule of a run already training (its checkpoints carry the schedule they were made with)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import NamedTuple

from scripts.chain.config import ChainConfig, config_from_dict
from scripts.chain.plan import MEASURED_THROUGHPUT, make_plan, planned_train
from scripts.chain.sizing import training_s


class Fill(NamedTuple):
    """The steps that fill the session, its tokens, the tokens per tokenize part that make them ('0': unchanged),
    and the line that says so."""

    total_steps: int
    tokens: int
    tokens_per_part: int
    line: str


def session_fill(cfg: ChainConfig, measured_path: Path = MEASURED_THROUGHPUT, now: float | None = None) -> Fill | None:
    """What fill_session makes of `cfg`, from the newest --smoke measurement on its machine, preset and sequence
    length (or plan_tokens_per_s where set); None where fill_session is 0 or nothing was measured."""
    if not cfg.fill_session:
        return None
    plan = make_plan(cfg, measured_path=measured_path)
    source = plan["tokens_per_s_source"]
    if not plan["tokens_per_s"] or not (source.startswith("measured") or source.startswith("plan_tokens_per_s")):
        return None
    train, _ = planned_train(cfg)
    step_tokens = train.step.total_batch_tokens
    # The share of the session, within its training budget (start-up is outside it), less its checkpoint writes.
    window_s = min(cfg.fill_session * cfg.session_limit_s, cfg.time_budget)
    train_s = training_s(window_s, train, plan["tokens_per_s"], plan["eval_share"])
    steps = int(train_s * plan["tokens_per_s"] / (1 + plan["eval_share"]) // step_tokens)
    data = _train_tokens_made(plan)
    capped = data is not None and steps * step_tokens > cfg.fill_passes * data
    if capped:
        steps = int(cfg.fill_passes * data) // step_tokens
    tokens = steps * step_tokens
    hours = tokens * (1 + plan["eval_share"]) / plan["tokens_per_s"] / 3600
    per_part = _tokens_per_part(cfg, plan, min(tokens, data) if data else tokens)
    ends = time.strftime("%H:%M", time.localtime((now or time.time()) + cfg.startup_margin_s + hours * 3600))
    why = (f"{_passes(cfg.fill_passes)} of the tokens the tokenize parts make" if capped else
           f"{cfg.fill_session:.0%} of a {cfg.session_limit_s / 3600:g}-h session")
    if data and tokens > data and not capped:
        why += f"; {tokens / data:.2f} passes over the {data / 1e9:.2f}B training tokens the tokenize parts make"
    part = f"; each tokenize part makes {per_part / 1e9:.2f}B tokens, what the run reads" if per_part else ""
    line = (f"fill_session: total_steps {steps} ({tokens / 1e9:.2f}B tokens, {why}) at the {plan['tokens_per_s']:,.0f} "
            f"tokens/s {source.split(' (')[0]}: {hours:.2f} h of training, evals included, ending about {ends} if a "
            f"session started now{part}")
    return Fill(steps, tokens, per_part, line)


def _passes(passes: float) -> str:
    return "one pass" if passes == 1 else f"{passes:g} passes"


def _train_tokens_made(plan: dict) -> int | None:
    """Training tokens the tokenize parts make (their validation shard aside); None where the chain reads token
    datasets or kernels of a size it does not know."""
    if not plan["parts"]:
        return None
    return plan["tokenized_tokens"] - plan["validation_tokens"]


def _tokens_per_part(cfg: ChainConfig, plan: dict, tokens: int) -> int:
    """Tokens per part that make `tokens` for training and the validation shard, in whole shards (0: the parts
    make no more than that already)."""
    parts = plan["parts"]
    if not parts:
        return 0
    shard = cfg.tokenize.config.shard_size
    needed = math.ceil((tokens + plan["validation_tokens"]) / parts / shard) * shard
    return needed if needed < plan["tokens_per_part"] else 0


def apply_fill(cfg: ChainConfig, fill: Fill | None) -> ChainConfig:
    """`cfg` with the fill's total_steps and tokens per part, checked as a config is (unchanged without a fill)."""
    if fill is None:
        return cfg
    tokenize = cfg.tokenize.raw()
    if fill.tokens_per_part:
        tokenize["settings"] = {**tokenize["settings"], "tokens_per_part": fill.tokens_per_part}
    raw = {**cfg.raw(), "total_steps": fill.total_steps, "tokenize": tokenize}
    return config_from_dict(raw, "fill_session")


def fixed_fill(cfg: ChainConfig, state, log=print) -> ChainConfig:
    """The chain's fill: the one its state holds (a run already started keeps its schedule), else the one measured
    now, written there. `state`: the chain's State."""
    if not cfg.fill_session:
        return cfg
    kept = state.data.get("fill")
    if kept:
        fill = Fill(kept["total_steps"], kept["tokens"], kept["tokens_per_part"], kept["line"])
        log(f"{fill.line.split(' at the ')[0]}, as fixed at this chain's first start")
        return apply_fill(cfg, fill)
    fill = session_fill(cfg)
    if fill is None:
        log(unmeasured_line(cfg))
        return cfg
    log(fill.line)
    state.data["fill"] = fill._asdict()
    state.save()
    return apply_fill(cfg, fill)


def unmeasured_line(cfg: ChainConfig) -> str:
    return (f"fill_session: no --smoke measurement on {cfg.accelerator or 'CPU'} for this preset and sequence length; "
            f"total_steps stays {cfg.total_steps}")
