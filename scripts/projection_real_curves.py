"""The stable-phase projection's intervals (shared/train/projection.py) held against real curves, not simulated ones:
calibration where scripts/projection_coverage.py, drawing its truth from the model the intervals assume, shows only
self-consistency.

- The loss interval, leave-one-out over the seven published Muon decays it is built from (`PUBLISHED_DECAYS`): each
  run's final loss predicted from its own stable-phase loss with the other six runs' gains.
- The HellaSwag line's interval, on a published GPT-2 124M run on FineWeb-Edu with HellaSwag on all 10,042 examples
  every 250 steps (shared/train/reference.py `REFERENCE_SOURCE`, AdamW with a cosine decay): the line is drawn
  through the later half of the evals up to a cut (HellaSwag every 1,000 or 500 steps, as the recipe's evals are) and
  read at the run's true final loss, so the line's own interval is tested, not the loss projection's.
One run and seven decays: a handful of real trials, not a coverage rate.

    .venv/bin/python scripts/projection_real_curves.py
"""

from __future__ import annotations

from shared.train.projection import (
    PUBLISHED_DECAYS,
    Decay,
    decay_gains,
    hellaswag_line,
    project_final_loss,
)
from shared.train.reference import HELLASWAG_EXAMPLES, REFERENCE_EVALS

CUTS = (0.5, 0.6, 0.71, 0.8)  # where the "stable phase" is cut, as shares of the reference run


def loss_leave_one_out() -> list[dict]:
    """Each published decay's final loss against the interval the other six give it."""
    gains, out = decay_gains(), []
    for i, (source, cooldown, stable, final) in enumerate(PUBLISHED_DECAYS):
        band = project_final_loss(stable, cooldown, Decay.published(gains[:i] + gains[i + 1:]))
        out.append({"source": source.split(":")[0], "final": final, "low": band.low, "high": band.high,
                    "covers": band.low <= final <= band.high})
    return out


def hellaswag_on_the_reference(every: int) -> list[dict]:
    """The line through the reference run's (loss, acc_norm) evals every `every` steps up to each cut, read at its
    final loss, against its final eval."""
    final_step, final_loss, final_right = REFERENCE_EVALS[-1]
    truth, out = final_right / HELLASWAG_EXAMPLES, []
    for cut in CUTS:
        pairs = [(loss, right / HELLASWAG_EXAMPLES) for step, loss, right in REFERENCE_EVALS
                 if step % every == 0 and step <= cut * final_step]
        pairs = pairs[len(pairs) // 2:] if len(pairs) >= 6 else pairs
        line, _ = hellaswag_line(pairs)
        band = line.interval(final_loss, 0.0)
        out.append({"cut": cut, "evals": len(pairs), "mid": band.mid, "low": band.low, "high": band.high,
                    "truth": truth, "covers": band.low <= truth <= band.high})
    return out


def main() -> None:
    print("final val loss, leave-one-out over the published Muon decays (90% interval):")
    for r in loss_leave_one_out():
        print(f"  {r['source']}: {r['final']:.4f} in {r['low']:.4f} to {r['high']:.4f}: "
              f"{'covered' if r['covers'] else 'MISSED'}")
    for every in (1000, 500):
        print(f"HellaSwag on the reference run, evals every {every} steps, read at its final loss (90% interval):")
        for r in hellaswag_on_the_reference(every):
            print(f"  cut at {r['cut']:.0%} ({r['evals']} evals): {r['mid']:.4f} ({r['low']:.4f} to {r['high']:.4f}, "
                  f"width {r['high'] - r['low']:.4f}); truth {r['truth']:.4f}: "
                  f"{'covered' if r['covers'] else 'MISSED'}")


if __name__ == "__main__":
    main()
