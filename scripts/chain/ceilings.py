"""The compiled step's MFU ceilings as `--plan` gives them (scripts/chain/plan.py `compiled_fit`), and the tokens/s a
plan takes from them before anything is measured: a share of the ceiling of the step a session tries first, with the
SDPA fallback's beside it. The ceilings come from scripts/tpu_compile.py's report: `mfu_ceiling` (the roofline, the
Pallas kernels' matmuls at 100% of the MXU) and `mfu_ceiling_mxu` (at the head dim's share of it,
scripts/hlo_cost.py `mxu_efficiency`); docs/tpu-throughput.md, "The kernels at their MXU share"."""

from __future__ import annotations

from shared.model.attention import SDPA
from shared.model_shape import ModelConfig

# The share of the compiled step's MFU ceiling (the head-dim-aware one where the step has Pallas kernels) a plan
# assumes a session reaches, for the kernel it expects and for the SDPA a session falls back to. The roofline
# overlaps nothing and runs each op at its own peak, which a real step does not (host tracing, the input pipeline,
# ops below peak). Not measured: 0.55 puts gpt2 at T=1024 inside the review's estimates (issue 55: 0.5-0.7M tokens/s
# on a v5e-8 with splash, 0.30-0.45M with SDPA, 1.7-2.6M on a v6e-8), which are estimates themselves; --smoke's
# measurement replaces it.
PLAN_CEILING_SHARE = 0.55


def head_dim_aware(report: dict) -> bool:
    """Whether the compiled step has Pallas kernels and a ceiling with their matmuls at the head dim's MXU share (a
    report cached before that figure existed has not)."""
    return bool(report.get("kernel_calls") and report.get("mfu_ceiling_mxu"))


def planning_ceiling(report: dict) -> float:
    """The compiled step's MFU ceiling a plan takes a share of: with its Pallas kernels' matmuls at the head dim's
    share of the MXU where it has any, else the roofline's."""
    return report["mfu_ceiling_mxu"] if head_dim_aware(report) else report.get("mfu_ceiling") or 0.0


def ceilings_text(report: dict, model: ModelConfig) -> str:
    """A compiled step's MFU ceilings, each in our count (6N + 12LCT) and llm.c's (6N + 6LCT: causal attention's
    half, docs/tpu-throughput.md section 1): with its Pallas kernels' matmuls at 100% of the MXU, then at the head
    dim's share of it, where the step has any."""
    llmc = model.flops_per_token_llmc() / model.flops_per_token()
    ceiling, mxu = report["mfu_ceiling"], planning_ceiling(report)
    if not head_dim_aware(report):
        return f"MFU ceiling {ceiling:.1%}, {ceiling * llmc:.1%} in llm.c's count (roofline estimate)"
    return (f"MFU ceiling {ceiling:.1%} with the kernels at 100% of the MXU, {mxu:.1%} with their matmuls at head "
            f"dim {report['head_dim']}'s share of a {report['mxu_width']}-wide MXU ({report['mxu_efficiency']:.0%}); "
            f"in llm.c's count {ceiling * llmc:.1%} and {mxu * llmc:.1%} (roofline estimates)")


def compiled_rates(report: dict, board_flops: float, model: ModelConfig, step_names: dict[str, str],
                   peaks: str) -> tuple[float, float | None, str]:
    """(tokens/s, tokens/s where a session falls back to SDPA or None, where the figures come from): PLAN_CEILING_SHARE
    of the compiled ceiling of the step a session tries first (`report`, with the fallbacks' reports `compiled_fit`
    kept in it), over a board of `board_flops` bf16 FLOP/s (`peaks`, as the line says it)."""
    flops = model.flops_per_token()
    ceiling = planning_ceiling(report)
    step = step_names.get(report["attention"], report["attention"])
    text = (f"estimate: {PLAN_CEILING_SHARE:.0%} of the {step} step's compiled MFU ceiling {ceiling:.1%}"
            + (" (its kernels at the head dim's MXU share)" if head_dim_aware(report) else "")
            + f" = {PLAN_CEILING_SHARE * ceiling:.1%} MFU of {peaks}")
    sdpa = (report.get("fallback_reports") or {}).get(SDPA)
    fallback = None
    if report["attention"] != SDPA and sdpa and sdpa.get("fits") and planning_ceiling(sdpa):
        fallback = board_flops * PLAN_CEILING_SHARE * planning_ceiling(sdpa) / flops
        text += (f"; {fallback:,.0f} tokens/s if a session falls back to SDPA ({PLAN_CEILING_SHARE:.0%} of its "
                 f"{planning_ceiling(sdpa):.1%})")
    return board_flops * PLAN_CEILING_SHARE * ceiling / flops, fallback, text + "; not measured: run --smoke first"
