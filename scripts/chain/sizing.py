"""How long each train session lasts where the chain sizes it from what its sessions measured (session_train_s:
the local demo and tests, whose start-up is most of a session and varies with the machine's load): the first,
before anything is measured, ends after MIN_STEPS steps; each later one trains long enough for at least MIN_STEPS
steps at the step time they took, counted from the end of its first step, so that however much longer its
start-up takes than the sessions' before it, training is never cut short. Every sized session may last
session_limit_s: its time limit stays real (the deadline, that less publish_margin_s, ends a start-up that runs
past it) without being a guess at start-up. What a session's own records say of those. And how much of a
session's budget trains, once its checkpoint writes are out (`training_s`: the plan's and fill's session)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

from scripts.chain.config import ChainConfig
from shared.config import TrainConfig
from shared.session_clock import estimate_checkpoint_seconds

# A measured step time, times this: what the next session allows for its steps.
HEADROOM = 1.5
MIN_STEPS = 10  # steps a sized session trains at the least, at the step time measured
END_STEPS = 2  # the trainer stops with the step in flight and one more unstarted (shared/train/trainer.py)


class SessionLength(NamedTuple):
    """A train session's time limit (seconds), why (where sized; '' for the fixed length), the steps after which
    it ends however much time is left (0: only its clock ends it), and its training in seconds counted from the
    end of its first step (0: until the deadline)."""

    limit_s: float
    why: str
    stop_after_steps: int = 0
    train_s: float = 0


def session_length(cfg: ChainConfig, sessions: list) -> SessionLength:
    """The next train session's length. Where sized (session_train_s): before any start-up was measured, ending
    after MIN_STEPS steps; after, training of session_train_s counted from the end of its first step, or longer
    where MIN_STEPS steps at the slowest step time measured (and the checkpoint at the end) need it. Either may
    last session_limit_s: a start-up measured before is no bound on the next one's (on CI's loaded machine one
    outgrew 1.5x the one before + 10 s, the margin sessions were once cut to, and left its session 3 steps), so
    none is cut to fit it; the longest start-up measured gives the length to expect."""
    if not cfg.session_train_s:
        return SessionLength(cfg.session_limit_s, "")
    limit = cfg.session_limit_s
    startup = max(((s["startup_s"], s["n"]) for s in sessions if s.get("startup_s")), default=None)
    if not startup:
        return SessionLength(limit, f"{MIN_STEPS} steps: nothing is measured before it", MIN_STEPS)
    training, why = cfg.session_train_s, "session_train_s"
    # The room the trainer keeps for its final write: the write time its checkpoint carries, which is the estimate
    # until a session has timed one before its last (shared/train/trainer.py session_clock).
    checkpoint = max([s.get("checkpoint_s") or 0.0 for s in sessions]
                     + [estimate_checkpoint_seconds(cfg.train.config.model.shape.num_params())])
    step = max(((s["step_s"], s["n"]) for s in sessions if s.get("step_s")), default=None)
    needed = math.ceil(HEADROOM * ((MIN_STEPS + END_STEPS) * (step[0] if step else 0.0) + 1.5 * checkpoint))
    if needed > training:
        training, why = needed, (f"{MIN_STEPS} steps at the {step[0]:.2f} s a step session {step[1]} took, "
                                 f"x{HEADROOM:g}, with the steps and checkpoint that end a session" if step else
                                 f"the final checkpoint's write, {checkpoint:.1f} s, x1.5, x{HEADROOM:g}")
    expected = math.ceil(startup[0] + training + cfg.publish_margin_s)
    cut = (f"; past the deadline, {limit - cfg.publish_margin_s:g} s from its start, which then ends its training"
           if expected > limit else "")
    return SessionLength(limit, f"{training:g} s of training ({why}) from the end of its "
                                f"first step, whatever start-up takes, + {cfg.publish_margin_s:g} s to publish; "
                                f"up to about {expected:g} s after a start-up like session {startup[1]}'s "
                                f"({startup[0]:.1f} s){cut}", 0, training)


def training_s(budget_s: float, train: TrainConfig, tokens_per_s: float, eval_share: float) -> float:
    """Seconds of a session's training budget (`budget_s`: the trainer counts it from the end of the first step, so
    start-up is not in it) that train, once the checkpoint writes inside it are out: the final one with the room the
    trainer keeps for it (1.5 writes, shared/train/checkpoint_writer.py seconds_after, and END_STEPS steps) and one
    every checkpoint_every steps. A write takes the trainer's own estimate before one is timed
    (shared/session_clock.py estimate_checkpoint_seconds); a step, its tokens at `tokens_per_s` with the evals'
    share. At least one step: a session trains one however short its budget."""
    write_s = estimate_checkpoint_seconds(train.model.shape.num_params())
    step_s = train.step.total_batch_tokens * (1 + eval_share) / tokens_per_s
    left = budget_s - 1.5 * write_s - END_STEPS * step_s
    if train.session.checkpoint_every and left > 0:
        left -= write_s * (left // (train.session.checkpoint_every * step_s + write_s))
    return max(left, step_s)


def session_measurements(metrics: Path) -> dict:
    """What a session's own records say (the last session's in its metrics.jsonl):
    `startup_s` (to the end of its first step), `step_s` (the mean step after its first two, which compile),
    `checkpoint_s` (its last checkpoint's write) and its `stop_reason`."""
    from shared.train.metrics import last_session_records

    own = last_session_records(metrics)
    found: dict = {}
    for r in own:
        if r.get("event") == "startup":
            found["startup_s"] = r["startup_s"]
        elif r.get("event") == "checkpoint":
            found["checkpoint_s"] = r["checkpoint_s"]
        elif r.get("event") == "session_end":
            found["stop_reason"] = r.get("stop_reason")
    # The mean over the steps after the first two; single log windows jitter (the host runs a step ahead).
    start_step = own[0].get("step", 0) if own else 0
    logged = [(r["step"], r["elapsed_s"]) for r in own if "loss" in r and r["step"] >= start_step + 2]
    if len(logged) >= 2 and logged[-1][0] > logged[0][0]:
        found["step_s"] = round((logged[-1][1] - logged[0][1]) / (logged[-1][0] - logged[0][0]), 3)
    return found
