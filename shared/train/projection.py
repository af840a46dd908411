"""Where a wsd run will end, projected from its stable phase: the final validation loss and HellaSwag, with a band,
and what to do (let it decay, or lengthen it with --extend and by how much).

A stable-phase loss sits well above the final one: the decay is where most of the last stretch of the loss comes
off. In published Muon runs with a linear decay to zero, the loss at the last eval before the decay fell by
0.137-0.172 x cooldown_frac of itself by the end (`PUBLISHED_DECAYS`: 4.0% at a 0.29 cooldown, 10% at 0.7). That
drop also holds the progress of the decay's steps, so it is read per unit of cooldown_frac, and the band is the
sources' spread. HellaSwag is projected from the run's own evals: a line through its (val loss, acc_norm) pairs,
read at the projected loss. Labels: these are projections from other runs, not measurements of this one.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

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


def decay_gains(decays=PUBLISHED_DECAYS) -> list[float]:
    """Each run's loss drop over its decay, as a fraction of its stable-phase loss per unit of cooldown_frac."""
    return [(stable - final) / stable / cooldown for _, cooldown, stable, final in decays]


@dataclasses.dataclass(frozen=True)
class Band:
    low: float
    mid: float
    high: float

    def __str__(self) -> str:
        return f"{self.mid:.4f} ({self.low:.4f} to {self.high:.4f})"


@dataclasses.dataclass(frozen=True)
class Projection:
    at_step: int  # the stable-phase eval it starts from
    stable_loss: float  # the val loss there, or extrapolated to a later stable-phase end (--extend)
    final_loss: Band
    hellaswag: Band | None
    verdict: str  # on track, borderline or trails
    steps_needed: int | None  # total_steps whose projected final loss (mid) reaches the target, where it trails


def project_final_loss(stable_loss: float, cooldown_frac: float, gains: list[float] | None = None) -> Band:
    """The final val loss after a decay over cooldown_frac of the run, from the loss where the decay starts."""
    gains = gains or decay_gains()
    at = [stable_loss * (1 - g * cooldown_frac) for g in (max(gains), statistics.median(gains), min(gains))]
    return Band(*at)


def project_hellaswag(pairs: list[tuple[float, float]], loss: Band) -> Band | None:
    """acc_norm at the projected loss, from a least-squares line through the run's (val loss, acc_norm) evals,
    widened by the line's residual spread. None with fewer than 3 evals or no spread in their losses."""
    if len(pairs) < 3 or max(x for x, _ in pairs) - min(x for x, _ in pairs) < 1e-6:
        return None
    slope, intercept = statistics.linear_regression([x for x, _ in pairs], [y for _, y in pairs])
    at = lambda x: intercept + slope * x  # noqa: E731
    spread = statistics.pstdev([y - at(x) for x, y in pairs])
    ends = sorted((at(loss.low), at(loss.high)))
    return Band(ends[0] - spread, at(loss.mid), ends[1] + spread)


def log_slope(points: list[tuple[int, float]]) -> float | None:
    """d(loss)/d(ln step) of a least-squares line through the later half of the stable phase's evals (>= 3)."""
    points = [(s, v) for s, v in points if s > 0]
    points = points[len(points) // 2:]
    if len(points) < 3:
        return None
    xs = [math.log(s) for s, _ in points]
    if len(set(xs)) < 2:
        return None
    return statistics.linear_regression(xs, [v for _, v in points]).slope


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
    final = project_final_loss(loss, cfg.cooldown_frac)
    by_step = {s: v for s, v in evals}
    pairs = [(by_step[r["step"]], r["hellaswag_acc_norm"]) for r in sorted(records, key=lambda r: r["step"])
             if "hellaswag_acc_norm" in r and r["step"] in by_step and r["step"] > 0]
    # HellaSwag sits at chance until the loss is low enough: the line is drawn through the later evals (of 6 or more)
    hellaswag = project_hellaswag(pairs[len(pairs) // 2:] if len(pairs) >= 6 else pairs, final)
    if final.high <= GPT2_124M_VAL_LOSS and (hellaswag is None or hellaswag.low >= GPT2_HELLASWAG):
        verdict = "on track"
    elif final.low > GPT2_124M_VAL_LOSS or (hellaswag is not None and hellaswag.high < GPT2_HELLASWAG):
        verdict = "trails"
    else:
        verdict = "borderline"
    needed = None
    if final.mid > GPT2_124M_VAL_LOSS and slope is not None and slope < 0:
        stable_needed = GPT2_124M_VAL_LOSS / (final.mid / loss)  # the stable loss whose decay (mid) reaches the target
        stable_steps = max(stable_end, step) * math.exp((stable_needed - loss) / slope)
        needed = math.ceil(stable_steps / (1 - cfg.cooldown_frac))
    return Projection(step, loss, final, hellaswag, verdict, needed)


def projection_lines(p: Projection, cfg: TrainConfig) -> list[str]:
    """The projection as log lines: the figures, then the recommendation."""
    gains = decay_gains()
    lines = [f"projection from the stable phase (step {p.at_step}, val loss {p.stable_loss:.4f}): final val loss "
             f"{p.final_loss} after a {cfg.cooldown_frac:g} cooldown (published Muon decays: "
             f"{min(gains):.3f}-{max(gains):.3f} of the loss per unit of cooldown_frac; "
             f"GPT-2 124M: {GPT2_124M_VAL_LOSS})"]
    if p.hellaswag:
        lines.append(f"projection: HellaSwag acc_norm {p.hellaswag} at that loss, from this run's evals "
                     f"(GPT-2 124M: {GPT2_HELLASWAG})")
    if p.verdict == "on track":
        lines.append("recommendation: on track; let the decay run")
    elif p.steps_needed:
        lines.append(f"recommendation: {p.verdict}; to reach {GPT2_124M_VAL_LOSS} (mid projection) lengthen the run to "
                     f"about {p.steps_needed:,} steps: run again with that total_steps and extend on (--extend)")
    else:
        lines.append(f"recommendation: {p.verdict}; the stable phase's trend is too short or flat to size a longer "
                     "run")
    return lines


def summary_line(record: dict) -> str:
    """A `projection` metrics record in one line (the chain's report of a session that passed the stable phase)."""
    loss = Band(**record["projected_val_loss"])
    hellaswag = Band(**record["projected_hellaswag"]) if record.get("projected_hellaswag") else None
    advice = (f"; lengthen to about {record['steps_needed']:,} steps (total_steps, with train.extend)"
              if record.get("steps_needed") else "")
    return (f"projection at the stable phase's end (step {record['step']}): final val loss {loss}"
            + (f", HellaSwag {hellaswag}" if hellaswag else "") + f": {record['verdict']}{advice}")
