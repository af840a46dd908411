"""The early go/no-go: every eval from 0.5B tokens on held against a published GPT-2 124M run on FineWeb-Edu, with
a verdict from 2B tokens on (go on, lengthen, or stop and change), long before the stable phase ends.

The reference is a whole logged run of build-nanogpt's AdamW recipe (`REFERENCE_SOURCE`): its validation loss and
HellaSwag acc_norm on all 10,042 examples every 250 steps of 524,288 tokens. At each eval the run's loss is read
against the reference's in two ways: the gap at the same tokens, and the token ratio, the tokens the reference took
to reach the run's loss over the run's own (1.5x: the run reaches in 1B tokens what the reference reached in 1.5B).
HellaSwag is held against the reference's, a running mean over five evals (its evals scatter by +-0.0046), at the
same tokens and at the same loss.

The verdict reads the whole run in reference tokens (ratio x the run's tokens) against the reference tokens where
its HellaSwag clears GPT-2's 0.2945 by two standard errors of a full-set eval (`goal_tokens`): past them "go on";
short of them "lengthen", with the total_steps that reach them at this ratio; a ratio under `MIN_RATIO` (the run
behind plain AdamW per token, where Muon should be 1.4-1.5x ahead) "stop and change". Where HellaSwag lags the
reference at the run's loss by more than two standard errors, the HellaSwag ratio sizes the run instead. A wsd run's
stable phase is held against a cosine run at nearly full learning rate by 2B tokens (0.92 of its peak): the decay
still to come makes the read conservative; Muon's lead shrinking over a long run (docs/recipe.md section 5) makes
it optimistic. Labels: a comparison with one published run, not a prediction interval.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from shared.train.metrics import GPT2_HELLASWAG

REFERENCE_SOURCE = ("garg-aayush/building-from-scratch gpt-2/log/train.txt @714e4ca, lines 315-20982: "
                    "build-nanogpt's AdamW recipe (lr 6e-4, 715 warm-up steps, cosine to 6e-5), 19,073 steps x "
                    "524,288 tokens of FineWeb-Edu sample-10BT, HellaSwag acc_norm on all 10,042 examples")
REFERENCE_NAME = "build-nanogpt's AdamW run"
REFERENCE_BATCH_TOKENS = 524_288
HELLASWAG_EXAMPLES = 10_042
# (step, validation loss, HellaSwag examples right of 10,042 by acc_norm) at every eval of REFERENCE_SOURCE; the eval
# at step s has trained s steps.
REFERENCE_EVALS = (
    (250, 6.1668, 2447), (500, 5.3127, 2358), (750, 4.6532, 2451), (1000, 4.1679, 2571), (1250, 3.9669, 2593),
    (1500, 3.8251, 2608), (1750, 3.7324, 2599), (2000, 3.6663, 2639), (2250, 3.6132, 2638), (2500, 3.5772, 2645),
    (2750, 3.5360, 2705), (3000, 3.5136, 2736), (3250, 3.4829, 2694), (3500, 3.4564, 2732), (3750, 3.4328, 2722),
    (4000, 3.4195, 2756), (4250, 3.3941, 2749), (4500, 3.3828, 2772), (4750, 3.3632, 2752), (5000, 3.3521, 2768),
    (5250, 3.3436, 2796), (5500, 3.3303, 2799), (5750, 3.3197, 2784), (6000, 3.3041, 2831), (6250, 3.2921, 2829),
    (6500, 3.2806, 2851), (6750, 3.2735, 2888), (7000, 3.2627, 2832), (7250, 3.2615, 2870), (7500, 3.2488, 2860),
    (7750, 3.2458, 2863), (8000, 3.2339, 2883), (8250, 3.2298, 2921), (8500, 3.2213, 2900), (8750, 3.2154, 2899),
    (9000, 3.2074, 2877), (9250, 3.2031, 2906), (9500, 3.1970, 2884), (9750, 3.1917, 2947), (10000, 3.1849, 2918),
    (10250, 3.1799, 2954), (10500, 3.1726, 2936), (10750, 3.1687, 2928), (11000, 3.1635, 2947), (11250, 3.1592,
    2954), (11500, 3.1528, 2996), (11750, 3.1493, 2986), (12000, 3.1436, 3007), (12250, 3.1382, 2988), (12500,
    3.1360, 2996), (12750, 3.1300, 2991), (13000, 3.1265, 3015), (13250, 3.1218, 3006), (13500, 3.1197, 3004),
    (13750, 3.1178, 3007), (14000, 3.1128, 3028), (14250, 3.1098, 3039), (14500, 3.1060, 3033), (14750, 3.1039,
    3046), (15000, 3.1012, 3048), (15250, 3.0984, 3066), (15500, 3.0956, 3069), (15750, 3.0928, 3056), (16000,
    3.0896, 3058), (16250, 3.0881, 3065), (16500, 3.0878, 3069), (16750, 3.0853, 3055), (17000, 3.0832, 3086),
    (17250, 3.0806, 3060), (17500, 3.0786, 3079), (17750, 3.0771, 3074), (18000, 3.0761, 3098), (18250, 3.0747,
    3073), (18500, 3.0737, 3064), (18750, 3.0715, 3081), (19000, 3.0687, 3091), (19072, 3.0656, 3079),
)
FIRST_CHECK_TOKENS = 500_000_000  # before this the loss falls too fast for a gap to mean much
VERDICT_TOKENS = 2_000_000_000  # the first eval at or past this gives the early verdict
MIN_RATIO = 0.9  # under this the run is behind plain AdamW per token: stop and change
SMOOTH = 2  # evals each side of the reference's HellaSwag running mean
GOAL_SE = 2  # the reference tokens where its HellaSwag clears GPT-2's by this many standard errors


def hellaswag_se(acc: float, examples: int = HELLASWAG_EXAMPLES) -> float:
    return math.sqrt(acc * (1 - acc) / max(1, examples))


@functools.lru_cache(maxsize=1)
def _reference() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ln tokens, val loss, HellaSwag running mean) of the reference's evals."""
    steps, losses, right = (np.array(column, dtype=np.float64) for column in zip(*REFERENCE_EVALS, strict=True))
    acc = right / HELLASWAG_EXAMPLES
    smooth = np.array([acc[max(0, i - SMOOTH):i + SMOOTH + 1].mean() for i in range(len(acc))])
    return np.log(steps * REFERENCE_BATCH_TOKENS), losses, smooth


def reference_end_tokens() -> int:
    return REFERENCE_EVALS[-1][0] * REFERENCE_BATCH_TOKENS


def reference_at(tokens: float) -> tuple[float, float] | None:
    """The reference's val loss and HellaSwag (running mean) at `tokens`, interpolated in ln tokens; None outside
    its evals."""
    ln_tokens, losses, smooth = _reference()
    x = math.log(max(tokens, 1))
    if not ln_tokens[0] <= x <= ln_tokens[-1]:
        return None
    return float(np.interp(x, ln_tokens, losses)), float(np.interp(x, ln_tokens, smooth))


def _tokens_where(values: np.ndarray, value: float, falling: bool) -> float | None:
    """The reference tokens where a monotone envelope of `values` first reaches `value` (None: never, or from the
    start)."""
    ln_tokens = _reference()[0]
    envelope = np.minimum.accumulate(values) if falling else np.maximum.accumulate(values)
    sign = -1 if falling else 1
    reached = sign * envelope >= sign * value
    if not reached.any() or reached[0]:
        return None
    i = int(np.argmax(reached))
    a, b = envelope[i - 1], envelope[i]
    frac = 1.0 if a == b else (value - a) / (b - a)
    return float(math.exp(ln_tokens[i - 1] + frac * (ln_tokens[i] - ln_tokens[i - 1])))


def reference_tokens_at_loss(loss: float) -> float | None:
    """The tokens the reference took to reach `loss`; None below its final loss (past its end)."""
    return _tokens_where(_reference()[1], loss, falling=True)


def reference_tokens_at_hellaswag(acc: float) -> float | None:
    """The tokens the reference's HellaSwag running mean took to reach `acc`; None past its best."""
    return _tokens_where(_reference()[2], acc, falling=False)


def goal_tokens() -> float:
    """The reference tokens where its HellaSwag running mean clears GPT-2's 0.2945 by GOAL_SE standard errors of a
    full-set eval: a run worth that many reference tokens ends there with room for its own eval's noise."""
    found = reference_tokens_at_hellaswag(GPT2_HELLASWAG + GOAL_SE * hellaswag_se(GPT2_HELLASWAG))
    return found if found else float(reference_end_tokens())


@dataclasses.dataclass(frozen=True)
class Check:
    step: int
    tokens: int
    val_loss: float
    reference_loss: float  # the reference's at these tokens
    ratio: float  # reference tokens to reach val_loss / tokens (a lower bound where past_end)
    past_end: bool  # the run's loss is below the reference's final one
    hellaswag: float | None = None
    hellaswag_se: float | None = None  # the run's eval and the reference's running mean together
    reference_hellaswag: float | None = None  # at these tokens
    reference_hellaswag_at_loss: float | None = None  # where the reference had the run's loss
    verdict: str | None = None  # "go on", "lengthen", "stop and change" from VERDICT_TOKENS on
    steps_needed: int | None = None  # total_steps that reach goal_tokens at this ratio (lengthen)
    reason: str = ""


def check(step: int, tokens: int, val_loss: float, total_steps: int, batch_tokens: int,
          hellaswag: float | None = None, examples: int = HELLASWAG_EXAMPLES) -> Check | None:
    """The run's eval at `step` against the reference; None before FIRST_CHECK_TOKENS or past the reference's
    end."""
    at = reference_at(tokens)
    if tokens < FIRST_CHECK_TOKENS or at is None:
        return None
    reference_loss, reference_hs = at
    reached = reference_tokens_at_loss(val_loss)
    past_end = reached is None and val_loss < reference_loss
    ratio = (reached or (reference_end_tokens() if past_end else tokens)) / tokens
    fields: dict = {}
    if hellaswag is not None:
        at_loss = reference_at(reached) if reached else None
        fields = {"hellaswag": hellaswag, "reference_hellaswag": reference_hs,
                  "reference_hellaswag_at_loss": at_loss[1] if at_loss else None,
                  "hellaswag_se": math.sqrt(hellaswag_se(hellaswag, examples) ** 2
                                            + hellaswag_se(reference_hs) ** 2 / (2 * SMOOTH + 1))}
    found = Check(step, tokens, val_loss, reference_loss, ratio, past_end, **fields)
    if tokens < VERDICT_TOKENS:
        return found
    return dataclasses.replace(found, **_verdict(found, total_steps, batch_tokens))


def _verdict(c: Check, total_steps: int, batch_tokens: int) -> dict:
    goal, worth = goal_tokens(), c.ratio * total_steps * batch_tokens
    if c.ratio < MIN_RATIO:
        return {"verdict": "stop and change",
                "reason": f"the run needs {1 / c.ratio:.2f}x the reference's tokens for its loss: behind plain AdamW "
                          "per token (a Muon run is expected 1.4-1.5x ahead); check the settings and the data"}
    lag = c.reference_hellaswag_at_loss is not None and c.hellaswag is not None and \
        c.reference_hellaswag_at_loss - c.hellaswag > 2 * c.hellaswag_se
    ratio, why = c.ratio, ""
    if lag:
        hs_reached = reference_tokens_at_hellaswag(c.hellaswag)
        ratio = min(ratio, (hs_reached or c.tokens) / c.tokens)
        why = (f"HellaSwag lags the reference at this loss by {c.reference_hellaswag_at_loss - c.hellaswag:.4f} "
               f"(> 2 standard errors): sized by HellaSwag's ratio {ratio:.2f}x; ")
        worth = ratio * total_steps * batch_tokens
    words = (f"at {ratio:.2f}x{' or more' if c.past_end and not lag else ''} the run's {total_steps:,} steps "
             f"({total_steps * batch_tokens / 1e9:.2f}B tokens) are worth {worth / 1e9:.1f}B of the reference's, "
             f"{'past' if worth >= goal else 'short of'} the {goal / 1e9:.2f}B where its HellaSwag clears "
             f"{GPT2_HELLASWAG} by {GOAL_SE} standard errors")
    if worth >= goal:
        return {"verdict": "go on", "reason": why + words}
    return {"verdict": "lengthen", "reason": why + words,
            "steps_needed": math.ceil(goal / max(ratio, 1e-9) / batch_tokens)}


def check_lines(c: Check) -> list[str]:
    """The check as log lines: where the run stands, then the verdict where there is one."""
    gap = c.val_loss - c.reference_loss
    where = ("below the reference's final loss" if c.past_end else
             f"where the reference was at {c.ratio * c.tokens / 1e9:.2f}B tokens")
    line = (f"reference check at {c.tokens / 1e9:.2f}B tokens (step {c.step}): val loss {c.val_loss:.4f} against "
            f"{REFERENCE_NAME}'s {c.reference_loss:.4f}: {'ahead' if gap <= 0 else 'behind'} by {abs(gap):.4f}, "
            f"{where} ({c.ratio:.2f}x{' or more' if c.past_end else ''} its tokens)")
    if c.hellaswag is not None:
        line += (f"; HellaSwag {c.hellaswag:.4f} +- {c.hellaswag_se:.4f} against its {c.reference_hellaswag:.4f} "
                 f"({c.hellaswag - c.reference_hellaswag:+.4f})")
        if c.reference_hellaswag_at_loss is not None:
            line += f", {c.hellaswag - c.reference_hellaswag_at_loss:+.4f} at the same loss"
    lines = [line]
    if c.verdict:
        lengthen = (f" to about {c.steps_needed:,} steps (total_steps; before the stable phase ends no extend is "
                    "needed)") if c.steps_needed else ""
        lines.append(f"early verdict at {c.tokens / 1e9:.2f}B tokens: {c.verdict}{lengthen}: {c.reason}")
    return lines


def check_record(c: Check) -> dict:
    """The check's fields for its `reference` metrics record (W&B logs them beside the evals)."""
    record = {"step": c.step, "tokens": c.tokens, "event": "reference", "reference_val_loss": c.reference_loss,
              "val_loss_vs_reference": c.val_loss - c.reference_loss, "reference_tokens_ratio": c.ratio,
              "reference_past_end": c.past_end}
    if c.hellaswag is not None:
        record.update(reference_hellaswag=c.reference_hellaswag,
                      hellaswag_vs_reference=c.hellaswag - c.reference_hellaswag,
                      hellaswag_vs_reference_at_loss=(c.hellaswag - c.reference_hellaswag_at_loss
                                                      if c.reference_hellaswag_at_loss is not None else None))
    if c.verdict:
        record.update(reference_verdict=c.verdict, reference_reason=c.reason,
                      reference_steps_needed=c.steps_needed)
    return record


def summary_line(record: dict) -> str:
    """The newest `reference` record in one line (the chain's session report)."""
    gap = record["val_loss_vs_reference"]
    line = (f"against {REFERENCE_NAME} at {record['tokens'] / 1e9:.2f}B tokens: val loss "
            f"{'ahead' if gap <= 0 else 'behind'} by {abs(gap):.4f} ({record['reference_tokens_ratio']:.2f}x its "
            "tokens)")
    if record.get("hellaswag_vs_reference") is not None:
        line += f", HellaSwag {record['hellaswag_vs_reference']:+.4f}"
    if record.get("reference_verdict"):
        needed = record.get("reference_steps_needed")
        line += f"; early verdict: {record['reference_verdict']}" + (f" to about {needed:,} steps" if needed else "")
    return line


def reference_curve(up_to_tokens: float) -> tuple[list[float], list[float], list[float]]:
    """The reference's tokens, val loss and HellaSwag running mean from FIRST_CHECK_TOKENS to `up_to_tokens` (the
    training plot draws them)."""
    ln_tokens, losses, smooth = _reference()
    tokens = np.exp(ln_tokens)
    keep = (tokens >= FIRST_CHECK_TOKENS) & (tokens <= up_to_tokens)
    return tokens[keep].tolist(), losses[keep].tolist(), smooth[keep].tolist()


def published_curve(records: list[dict]) -> tuple | None:
    """Where the run was held against the reference (its `reference` records): the reference's tokens, val loss,
    HellaSwag and name up to the run's newest check, for the training plot (None where it never was)."""
    checked = [r["tokens"] for r in records if r.get("event") == "reference"]
    return (*reference_curve(max(checked)), REFERENCE_NAME) if checked else None
