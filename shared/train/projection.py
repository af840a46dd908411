"""Where a wsd run will end, projected from its stable phase: the final validation loss and HellaSwag, each with a
prediction interval, a verdict that says plainly when it cannot decide, and how long a run would reach both targets.

A stable-phase loss sits well above the final one: the decay is where most of the last stretch of the loss comes
off. In published Muon runs with a linear decay to zero, the loss at the last eval before the decay fell by
0.137-0.172 x cooldown_frac of itself by the end (`PUBLISHED_DECAYS`), so the final loss is read off the gains'
mean, and its interval is a new gain's prediction interval from those seven (Student t, k - 1 degrees of freedom).
HellaSwag is projected from the run's own evals: an ordinary-least-squares line through its (val loss, acc_norm)
pairs, read at the projected loss, with the line's prediction interval (t quantile with n - 2 degrees of freedom,
the residual variance, the leverage of the extrapolated point) widened by the final loss's own uncertainty.
`scripts/projection_coverage.py` checks by simulation that the intervals hold the truth at their nominal rate: that
is self-consistency (the simulation draws its truth from the model the intervals assume), not calibration.
`scripts/projection_real_curves.py` holds them against real curves: the loss interval leave-one-out over the
published decays (6 of 7 covered), the HellaSwag line on a published FineWeb-Edu run (covered at the recipe's cut).
The HellaSwag interval is informational: about +-0.005 to +-0.035 wide against a margin of about 0.005, it rarely
decides; the early check against a published run (shared/train/reference.py) is the go/no-go, from 2B tokens.
Labels: these are projections, not measurements of this run.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from shared.config import TrainConfig
from shared.train.metrics import GPT2_124M_VAL_LOSS, GPT2_HELLASWAG

# (source: modded-nanogpt @f411b3d records/<path>:<line of the stable-phase eval>,<line of the final eval>,
#  cooldown_frac, val loss at the last eval at or before the decay's start, final val loss). All Muon for the
# blocks' matrices, 524,288-token batches, linear decay to zero.
PUBLISHED_DECAYS = (
    ("track_1_short/2024-10-10_Muon/eb5659d0-fb6a-49e5-a311-f1f89412f726.txt:4996,6836", 1800 / 6200, 3.4157, 3.2785),
    ("track_1_short/2024-10-14_ModernArch/dabaaddd-237c-4ec9-939d-6608a9ed5e27.txt:4232,5719", 1450 / 5100,
     3.4103, 3.2741),
    ("track_1_short/2024-10-29_Optimizers/8d6193f4-27fc-4e68-899f-af70019a4d54.txt:4246,5733", 1450 / 5100,
     3.4114, 3.2760),
    ("track_1_short/2025-01-04_SoftCap/31d6c427-f1f7-4d8a-91be-a67b5dcd13fd.txt:1371,2017", 0.4, 3.5205, 3.2785),
    ("track_2_medium/2025-03-06_LongerCooldown/779c041a-2a37-45d2-a18b-ec0f223c2bb7.txt:3469,7703", 0.6,
     3.1805, 2.9184),
    ("track_3_optimization/results/51ece938-03c5-4343-8dcc-3f3336b07008.txt:385,404", 0.7, 3.63309, 3.27924),
    ("track_3_optimization/results/1bd8db7a-f3a3-4195-856d-cab7e0816443.txt:385,415", 0.7, 3.64527, 3.27874),
)
LEVEL = 0.9  # the intervals' nominal coverage: the truth lies outside 5% of the time on each side
MIN_FIT_EVALS = 4  # HellaSwag evals the line needs (2 degrees of freedom: with 1, t's 90% quantile is 6.3)
MIN_LOSS_SPAN = 0.02  # the evals' loss span the line needs: over less, acc_norm's noise (+-0.0045 at 10,042
# examples) makes its slope meaningless
MAX_LENGTHEN = 20  # the longest stable phase a suggestion reads the trend out to, in multiples of this one


def decay_gains(decays=PUBLISHED_DECAYS) -> list[float]:
    """Each run's loss drop over its decay, as a fraction of its stable-phase loss per unit of cooldown_frac."""
    return [(stable - final) / stable / cooldown for _, cooldown, stable, final in decays]


@functools.lru_cache(maxsize=256)
def t_quantile(level: float, df: float) -> float:
    """x with P(|T| <= x) = level for Student's T with df >= 1 degrees of freedom. With T = sqrt(df) tan(theta),
    theta's density on [0, pi/2] is proportional to cos(theta)^(df - 1), bounded and smooth: x is read off its
    cumulative integral (trapezoids on 20,001 points; within 1e-4 of the tables)."""
    theta = np.linspace(0.0, math.pi / 2, 20001)
    density = np.cos(theta) ** (df - 1.0)
    cumulative = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2)])
    return float(math.sqrt(df) * math.tan(np.interp(level, cumulative / cumulative[-1], theta)))


@dataclasses.dataclass(frozen=True)
class Band:
    low: float
    mid: float
    high: float

    def __str__(self) -> str:
        return f"{self.mid:.4f} ({self.low:.4f} to {self.high:.4f})"

    def described(self, interval: str) -> str:
        """The mid, then the interval named: "0.2800 (90% prediction interval 0.2700 to 0.2900)"."""
        return f"{self.mid:.4f} ({interval} {self.low:.4f} to {self.high:.4f})"


@dataclasses.dataclass(frozen=True)
class Decay:
    """The published gains' summary: a new run's gain is predicted as mean +- t * spread."""
    mean: float
    spread: float  # the predictive standard deviation of a new gain: sd * sqrt(1 + 1/k)
    df: int

    @classmethod
    def published(cls, gains: list[float] | None = None) -> Decay:
        gains = gains or decay_gains()
        return cls(float(np.mean(gains)), float(np.std(gains, ddof=1) * math.sqrt(1 + 1 / len(gains))),
                   len(gains) - 1)


@dataclasses.dataclass(frozen=True)
class Line:
    """An ordinary-least-squares line acc_norm = intercept + slope * loss, with its prediction interval."""
    intercept: float
    slope: float
    residual_var: float  # sum of squared residuals / (n - 2)
    n: int
    mean_x: float
    sxx: float  # sum of (x - mean_x)^2

    @classmethod
    def fit(cls, pairs: list[tuple[float, float]]) -> Line:
        x, y = np.array(pairs, dtype=np.float64).T
        mean_x, sxx = float(x.mean()), float(((x - x.mean()) ** 2).sum())
        slope = float(((x - mean_x) * (y - y.mean())).sum() / sxx)
        intercept = float(y.mean() - slope * mean_x)
        residuals = y - (intercept + slope * x)
        return cls(intercept, slope, float((residuals ** 2).sum() / (len(x) - 2)), len(x), mean_x, sxx)

    def at(self, x: float) -> float:
        return self.intercept + self.slope * x

    def interval(self, x: float, x_sd: float, level: float = LEVEL) -> Band:
        """A new eval's acc_norm at loss x, itself known to +- x_sd: the OLS prediction variance (the residual
        variance times 1 + the leverage of x) plus what x's uncertainty carries through the slope."""
        leverage = 1 / self.n + (x - self.mean_x) ** 2 / self.sxx
        half = t_quantile(level, self.n - 2) * math.sqrt(self.residual_var * (1 + leverage) + (self.slope * x_sd) ** 2)
        return Band(self.at(x) - half, self.at(x), self.at(x) + half)


@dataclasses.dataclass(frozen=True)
class Projection:
    at_step: int  # the stable-phase eval it starts from
    stable_loss: float  # the val loss there, or extrapolated to a later stable-phase end (--extend)
    final_loss: Band
    hellaswag: Band | None
    verdict: str  # "on track", "behind" or "cannot decide yet"
    reason: str  # why it cannot decide, or what the verdict rests on ("" where both intervals decide)
    hellaswag_note: str  # how the HellaSwag line was drawn, or why there is none
    steps_for_loss: int | None  # total_steps whose mid projected final loss reaches the target
    steps_for_hellaswag: int | None  # total_steps whose mid projected final HellaSwag reaches the target
    level: float = LEVEL

    @property
    def steps_needed(self) -> int | None:
        """The longer of the two: the run needs both targets."""
        found = [s for s in (self.steps_for_loss, self.steps_for_hellaswag) if s]
        return max(found) if found else None

    @property
    def binds(self) -> str | None:
        """Which target sets steps_needed."""
        if not self.steps_needed:
            return None
        return "HellaSwag" if self.steps_needed == self.steps_for_hellaswag else "loss"


def project_final_loss(stable_loss: float, cooldown_frac: float, decay: Decay | None = None,
                       level: float = LEVEL) -> Band:
    """The final val loss after a decay over cooldown_frac of the run, from the loss where the decay starts: the
    mean published gain, and a new gain's prediction interval."""
    decay = decay or Decay.published()
    half = t_quantile(level, decay.df) * decay.spread
    return Band(*(stable_loss * (1 - g * cooldown_frac) for g in (decay.mean + half, decay.mean, decay.mean - half)))


def final_loss_sd(stable_loss: float, cooldown_frac: float, decay: Decay | None = None) -> float:
    """The projected final loss's predictive standard deviation (from the gains' spread)."""
    return stable_loss * cooldown_frac * (decay or Decay.published()).spread


def hellaswag_line(pairs: list[tuple[float, float]]) -> tuple[Line | None, str]:
    """The line through the (val loss, acc_norm) evals, or None and why (too few, too narrow a span)."""
    if len(pairs) < MIN_FIT_EVALS:
        return None, f"only {len(pairs)} HellaSwag eval(s) to draw its line through ({MIN_FIT_EVALS} needed)"
    losses = [x for x, _ in pairs]
    span = max(losses) - min(losses)
    if span < MIN_LOSS_SPAN:
        return None, f"the HellaSwag evals' losses span only {span:.4f} ({MIN_LOSS_SPAN} needed)"
    return Line.fit(pairs), (f"a line through this run's {len(pairs)} evals at losses {min(losses):.4f} to "
                             f"{max(losses):.4f}")


def project_hellaswag(pairs: list[tuple[float, float]], loss: Band, loss_sd: float = 0.0,
                      level: float = LEVEL) -> Band | None:
    """acc_norm at the projected loss (mid) with its prediction interval; None where the line can't be drawn."""
    line, _ = hellaswag_line(pairs)
    return line.interval(loss.mid, loss_sd, level) if line else None


def log_slope(points: list[tuple[int, float]]) -> float | None:
    """d(loss)/d(ln step) of a least-squares line through the later half of the stable phase's evals (>= 3)."""
    points = [(s, v) for s, v in points if s > 0]
    points = points[len(points) // 2:]
    if len(points) < 3:
        return None
    xs = np.log([s for s, _ in points])
    if np.ptp(xs) == 0:
        return None
    return float(np.polyfit(xs, [v for _, v in points], 1)[0])


def steps_to_reach(final_loss: float, stable_loss: float, base_step: int, slope: float, cooldown_frac: float,
                   decay: Decay | None = None) -> int | None:
    """total_steps whose stable phase, carried on along its log-linear trend, ends at the loss whose decay (mean
    gain) lands on final_loss; None past MAX_LENGTHEN times this stable phase (a trend read that far is no guide)."""
    needed = final_loss / (1 - (decay or Decay.published()).mean * cooldown_frac)
    growth = (needed - stable_loss) / slope
    if growth > math.log(MAX_LENGTHEN):
        return None
    return math.ceil(base_step * math.exp(growth) / (1 - cooldown_frac))


def hellaswag_pairs(records: list[dict], by_step: dict[int, float]) -> list[tuple[float, float]]:
    """(val loss, acc_norm) at each eval that scored both; of 6 or more, the later half only: HellaSwag sits near
    chance while the loss is high, which would bend the line."""
    pairs = [(by_step[r["step"]], r["hellaswag_acc_norm"]) for r in sorted(records, key=lambda r: r["step"])
             if "hellaswag_acc_norm" in r and r["step"] in by_step and r["step"] > 0]
    return pairs[len(pairs) // 2:] if len(pairs) >= 6 else pairs


def judge(loss: Band, hellaswag: Band | None, hellaswag_missing: str) -> tuple[str, str]:
    """The verdict and its reason: behind where either interval lies wholly short of its target, on track where
    both clear theirs (the loss alone where the run scores no HellaSwag), otherwise it cannot decide yet."""
    if loss.low > GPT2_124M_VAL_LOSS:
        return "behind", f"even the loss's interval lies above {GPT2_124M_VAL_LOSS}"
    if hellaswag and hellaswag.high < GPT2_HELLASWAG:
        return "behind", f"even HellaSwag's interval lies below {GPT2_HELLASWAG}"
    undecided = []
    if loss.high > GPT2_124M_VAL_LOSS:
        undecided.append(f"the loss's interval straddles {GPT2_124M_VAL_LOSS}")
    if hellaswag and hellaswag.low < GPT2_HELLASWAG:
        undecided.append(f"HellaSwag's interval straddles {GPT2_HELLASWAG}")
    elif hellaswag is None and hellaswag_missing:
        undecided.append(hellaswag_missing)
    return ("cannot decide yet", "; ".join(undecided)) if undecided else ("on track", "")


def project(records: list[dict], cfg: TrainConfig, at_step: int, stable_end: int) -> Projection | None:
    """The projection from the run's metrics records up to `at_step` (its stable phase's end, or the newest eval
    before it), for the schedule `cfg` whose stable phase ends at `stable_end`. Where that is later than at_step
    (--extend), the stable-phase loss is carried on along its log-linear trend to stable_end."""
    evals = sorted((r["step"], r["val_loss"]) for r in records if "val_loss" in r and r["step"] <= at_step)
    if not evals:
        return None
    step, loss = evals[-1]
    slope = log_slope(evals)
    if stable_end > step and slope is not None and slope < 0:
        loss += slope * math.log(stable_end / step)
    cooldown = cfg.lr_schedule.cooldown_frac
    final, loss_sd = project_final_loss(loss, cooldown), final_loss_sd(loss, cooldown)
    pairs = hellaswag_pairs(records, dict(evals))
    line, note = hellaswag_line(pairs)
    hellaswag = line.interval(final.mid, loss_sd) if line else None
    any_hellaswag = any("hellaswag_acc_norm" in r and r["step"] <= at_step for r in records)
    verdict, reason = judge(final, hellaswag, note if any_hellaswag else "")
    if not any_hellaswag:
        reason, note = reason or "the loss alone: the run scores no HellaSwag", "no HellaSwag evals"
    base, trend = max(stable_end, step), slope is not None and slope < 0
    for_loss = (steps_to_reach(GPT2_124M_VAL_LOSS, loss, base, slope, cfg.lr_schedule.cooldown_frac)
                if trend and final.mid > GPT2_124M_VAL_LOSS else None)
    for_hellaswag = None
    if trend and hellaswag and hellaswag.mid < GPT2_HELLASWAG and line.slope < 0:
        target_loss = (GPT2_HELLASWAG - line.intercept) / line.slope  # where the line reaches the target
        for_hellaswag = steps_to_reach(target_loss, loss, base, slope, cfg.lr_schedule.cooldown_frac)
    return Projection(step, loss, final, hellaswag, verdict, reason, note, for_loss, for_hellaswag)


def sizing(p: Projection) -> str:
    """How long a run would reach both targets on the mid projections, and which of the two binds."""
    hellaswag_short = p.hellaswag is not None and p.hellaswag.mid < GPT2_HELLASWAG
    unsized = hellaswag_short and p.steps_for_hellaswag is None
    if p.steps_needed and not unsized:
        other = p.steps_for_loss if p.binds == "HellaSwag" else p.steps_for_hellaswag
        other_name = "the loss" if p.binds == "HellaSwag" else "HellaSwag"
        alone = f"{other_name} alone needs about {other:,}" if other else f"{other_name}'s mid already reaches it"
        return (f"to reach both targets (mid projections) lengthen the run to about {p.steps_needed:,} steps "
                f"({p.binds} binds; {alone}): run again with that total_steps and extend on (--extend)")
    if unsized:
        return (f"HellaSwag's line gives no length within {MAX_LENGTHEN}x of this stable phase that reaches "
                f"{GPT2_HELLASWAG}: too flat or noisy to size a longer run")
    if p.final_loss.mid > GPT2_124M_VAL_LOSS:
        return "the stable phase's trend is too short or flat to size a longer run"
    if p.hellaswag is None:
        return "the loss's mid projection reaches its target, HellaSwag's is unknown: let the decay run"
    return "the mid projections reach both targets: let the decay run and read its final evals"


def projection_lines(p: Projection, cfg: TrainConfig) -> list[str]:
    """The projection as log lines: the figures, then the verdict and recommendation."""
    gains, level = decay_gains(), f"{p.level:.0%}"
    lines = [f"projection from the stable phase (step {p.at_step}, val loss {p.stable_loss:.4f}): final val loss "
             f"{p.final_loss.described(level + ' interval')} after a {cfg.lr_schedule.cooldown_frac:g} cooldown "
             f"(published Muon decays: {min(gains):.3f}-{max(gains):.3f} of the loss per unit of cooldown_frac; "
             f"GPT-2 124M: {GPT2_124M_VAL_LOSS})"]
    if p.hellaswag:
        lines.append(f"projection: HellaSwag acc_norm {p.hellaswag.described(level + ' prediction interval')} at "
                     f"that loss, from {p.hellaswag_note} (GPT-2 124M: {GPT2_HELLASWAG}); informational: the "
                     "interval is several times the margin in question; the go/no-go is the check against a "
                     "published run from 2B tokens (shared/train/reference.py)")
    else:
        lines.append(f"projection: HellaSwag not projected: {p.hellaswag_note}")
    if p.verdict == "on track":
        lines.append(f"recommendation: on track (both {level} intervals clear GPT-2 124M's); let the decay run")
    else:
        lines.append(f"recommendation: {p.verdict} ({p.reason}); {sizing(p)}")
    return lines


def projection_record(p: Projection) -> dict:
    """The projection's fields for its `projection` metrics record (summary_line reads them back)."""
    return {"projected_val_loss": dataclasses.asdict(p.final_loss),
            "projected_hellaswag": p.hellaswag and dataclasses.asdict(p.hellaswag), "level": p.level,
            "verdict": p.verdict, "reason": p.reason, "steps_needed": p.steps_needed, "binds": p.binds,
            "steps_for_loss": p.steps_for_loss, "steps_for_hellaswag": p.steps_for_hellaswag}


def summary_line(record: dict) -> str:
    """A `projection` metrics record in one line (the chain's report of a session that passed the stable phase)."""
    loss = Band(**record["projected_val_loss"])
    hellaswag = Band(**record["projected_hellaswag"]) if record.get("projected_hellaswag") else None
    reason = f" ({record['reason']})" if record.get("reason") else ""
    binds = f"{record['binds']} binds; " if record.get("binds") else ""
    advice = (f"; lengthen to about {record['steps_needed']:,} steps ({binds}total_steps, with train.extend)"
              if record.get("steps_needed") else "")
    return (f"projection at the stable phase's end (step {record['step']}): final val loss {loss}"
            + (f", HellaSwag {hellaswag}" if hellaswag else "") + f": {record['verdict']}{reason}{advice}")
