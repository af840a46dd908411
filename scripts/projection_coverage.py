"""How often the stable-phase projection's intervals (shared/train/projection.py) hold the truth, on simulated
runs of the recipe (gpt2, wsd, 13,352 steps, cooldown_frac 0.29: the stable phase ends at step 9,480).

Each simulated run draws
- a true loss curve, a power law in steps L(t) = L_inf + A t^-alpha through L(1000) in [3.75, 4.05] and the
  stable phase's end in [3.33, 3.50], alpha in [0.3, 0.6]; each val-loss eval (every 250 steps) adds N(0, 0.001);
- a decay gain from the published gains' predictive distribution (their mean + spread x Student t, 6 degrees of
  freedom): the final loss is the stable phase's end x (1 - gain x cooldown_frac);
- a true HellaSwag-vs-loss relation, acc = p_ref + b (L - 3.29) + curvature (L - 3.29)^2 with p_ref in [0.275,
  0.31], b in [-0.12, -0.05]; each HellaSwag eval (every 1,000 steps, the stable phase's end, the last step) is a
  binomial draw over n examples. These ranges are illustrative, not fitted to a measured run.
The truth is the final eval's loss and acc_norm; the projection sees the evals up to the stable phase's end.
The truth is drawn from the same model the intervals assume, so the coverage found is self-consistency, not
calibration; scripts/projection_real_curves.py holds the intervals against real curves.

    .venv/bin/python scripts/projection_coverage.py [--runs 4000] [--seed 0] [--examples 10042] [--curvature 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

from shared.config import TrainConfig
from shared.train.metrics import GPT2_124M_VAL_LOSS, GPT2_HELLASWAG
from shared.train.projection import Decay, project

RECIPE = TrainConfig.from_dict({"preset": "gpt2", "optimizer": "muon", "schedule": "wsd", "total_steps": 13352,
                                "cooldown_frac": 0.29})
STABLE_END = 9480  # shared/runtime/optim.py stable_phase_end(RECIPE)
VAL_NOISE = 0.001  # a val-loss eval's own noise (the same val tokens each time: small)


@dataclasses.dataclass(frozen=True)
class Run:
    """One simulated run: its evals up to the stable phase's end, and its true final loss and acc_norm."""
    records: list[dict]
    final_loss: float
    final_hellaswag: float


def simulate_run(rng: np.random.Generator, examples: int, curvature: float, hellaswag_every: int = 1000) -> Run:
    alpha, early, stable = rng.uniform(0.3, 0.6), rng.uniform(3.75, 4.05), rng.uniform(3.33, 3.50)
    scale = (early - stable) / (1000 ** -alpha - STABLE_END ** -alpha)
    floor = stable - scale * STABLE_END ** -alpha
    p_ref, slope = rng.uniform(0.275, 0.31), rng.uniform(-0.12, -0.05)

    def acc(loss: float) -> float:  # a finite HellaSwag set's acc_norm at this loss
        p = p_ref + slope * (loss - 3.29) + curvature * (loss - 3.29) ** 2
        return rng.binomial(examples, min(max(p, 0.25), 1.0)) / examples

    steps = sorted(set(range(250, STABLE_END, 250)) | {STABLE_END})
    records = [{"step": 0, "val_loss": math.log(50257)}, {"step": 0, "hellaswag_acc_norm": 0.25}]
    for step in steps:
        loss = floor + scale * step ** -alpha
        records.append({"step": step, "val_loss": loss + rng.normal(0, VAL_NOISE)})
        if step % hellaswag_every == 0 or step == STABLE_END:
            records.append({"step": step, "hellaswag_acc_norm": acc(loss)})
    decay = Decay.published()
    gain = decay.mean + decay.spread * rng.standard_t(decay.df)
    final = stable * (1 - gain * RECIPE.lr_schedule.cooldown_frac)
    return Run(records, final + rng.normal(0, VAL_NOISE), acc(final))


def simulate(runs: int = 4000, seed: int = 0, examples: int = 10042, curvature: float = 0.0,
             hellaswag_every: int = 1000) -> dict:
    """Coverage of both intervals and the verdicts' rates over `runs` simulated runs: on_track_wrong is the share
    of the runs that miss a target (final loss above 3.2924 or acc_norm below 0.2945) called on track,
    behind_wrong that of the runs that reach both called behind."""
    rng = np.random.default_rng(seed)
    counts = dict(runs=0, loss_in=0, hellaswag_in=0, on_track=0, behind=0, undecided=0, on_track_wrong=0,
                  behind_wrong=0, hellaswag_binds=0, reach=0)
    widths = []
    for _ in range(runs):
        run = simulate_run(rng, examples, curvature, hellaswag_every)
        p = project(run.records, RECIPE, STABLE_END, STABLE_END)
        counts["runs"] += 1
        counts["loss_in"] += p.final_loss.low <= run.final_loss <= p.final_loss.high
        counts["hellaswag_in"] += p.hellaswag.low <= run.final_hellaswag <= p.hellaswag.high
        widths.append(p.hellaswag.high - p.hellaswag.low)
        reaches = run.final_loss <= GPT2_124M_VAL_LOSS and run.final_hellaswag >= GPT2_HELLASWAG
        key = {"on track": "on_track", "behind": "behind"}.get(p.verdict, "undecided")
        counts[key] += 1
        counts["reach"] += reaches
        counts["on_track_wrong"] += key == "on_track" and not reaches
        counts["behind_wrong"] += key == "behind" and reaches
        counts["hellaswag_binds"] += p.binds == "HellaSwag"
    n, reach = counts["runs"], counts["reach"]
    return {"runs": n, "level": p.level, "loss_coverage": counts["loss_in"] / n,
            "hellaswag_coverage": counts["hellaswag_in"] / n, "hellaswag_median_width": float(np.median(widths)),
            "reach": reach / n, "on_track_wrong": counts["on_track_wrong"] / max(n - reach, 1),
            "behind_wrong": counts["behind_wrong"] / max(reach, 1),
            **{k: counts[k] / n for k in ("on_track", "behind", "undecided", "hellaswag_binds")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--examples", type=int, default=10042, help="HellaSwag examples per eval")
    parser.add_argument("--curvature", type=float, default=0.0, help="acc_norm's curvature in the loss")
    parser.add_argument("--hellaswag-every", type=int, default=1000, help="steps between HellaSwag evals")
    args = parser.parse_args()
    found = simulate(args.runs, args.seed, args.examples, args.curvature, args.hellaswag_every)
    se = math.sqrt(found["level"] * (1 - found["level"]) / found["runs"])
    print(f"{found['runs']} simulated runs, {args.examples} HellaSwag examples every {args.hellaswag_every} steps, "
          f"curvature {args.curvature}, seed {args.seed}; nominal {found['level']:.0%} (binomial standard error "
          f"{se:.3f}); self-consistency, not calibration: the truth is drawn from the model the intervals assume")
    print(f"  final val loss interval covers the truth: {found['loss_coverage']:.3f}")
    print(f"  final HellaSwag interval covers the truth: {found['hellaswag_coverage']:.3f} "
          f"(median width {found['hellaswag_median_width']:.4f})")
    print(f"  verdicts: on track {found['on_track']:.3f}, behind {found['behind']:.3f}, cannot decide yet "
          f"{found['undecided']:.3f}; {found['reach']:.3f} of the runs reach both targets")
    print(f"  called on track though a target is missed: {found['on_track_wrong']:.3f} of those runs; called behind "
          f"though both are reached: {found['behind_wrong']:.3f} of those; HellaSwag binds the suggested length in "
          f"{found['hellaswag_binds']:.3f} of all runs")


if __name__ == "__main__":
    main()
