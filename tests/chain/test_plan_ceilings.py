"""--plan's compiled line gives the head-dim-aware MFU ceiling and llm.c's count beside ours, and its tokens/s is a
share of the compiled ceiling of the kernel a session tries first, with the SDPA fallback's beside it
(scripts/chain/ceilings.py). Here from reports carrying the compiler's figures for gpt2 at T=1024
(docs/tpu-throughput.md, "The kernels at their MXU share": 65.6% / 60.4% on v5e-8, 48.2% / 41.7% on v6e-8); with
the compiler itself, tests/train/test_tpu_compile.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import example_config

from scripts.chain.ceilings import PLAN_CEILING_SHARE
from scripts.chain.config import config_from_dict
from scripts.chain.plan import print_plan

GPT2_FLOPS, GPT2_FLOPS_LLMC = 860_101_632, 803_478_528  # docs/tpu-throughput.md section 1


def _report(attention: str, ceiling: float, mxu: float | None, width: int, micro_batch: int) -> dict:
    kernels = {"kernel_calls": 48, "mfu_ceiling_mxu": mxu, "head_dim": 64, "mxu_width": width,
               "mxu_efficiency": min(1.0, 64 / width)} if mxu else {"kernel_calls": 0, "mfu_ceiling_mxu": ceiling}
    return {"attention": attention, "micro_batch": micro_batch, "peak_bytes": 7.8 * 2**30,
            "hbm_bytes": (16 if width == 128 else 32) * 2**30, "fits": True, "free_fraction": 0.5,
            "versions": {"libtpu": "0.0.17"}, "preset": "gpt2", "collectives": [], "mfu_ceiling": ceiling, **kernels}


# The compiler's figures (docs/tpu-throughput.md: v5e-8 splash 65.6 / 60.4%, flash 61.9%, SDPA 33.0%; v6e-8 splash
# 48.2 / 41.7%); flash's head-dim-aware and v6e's flash and SDPA ceilings are stand-ins of the same shape.
STEPS = {
    "TpuV5E8": {"splash": _report("pallas-splash", 0.656, 0.604, 128, 128),
                "flash": _report("pallas-flash", 0.619, 0.571, 128, 128),
                "sdpa": _report("sdpa", 0.330, None, 128, 64)},
    "TpuV6E8": {"splash": _report("pallas-splash", 0.482, 0.417, 256, 256),
                "flash": _report("pallas-flash", 0.345, 0.300, 256, 256),
                "sdpa": _report("sdpa", 0.200, None, 256, 128)},
}


@pytest.mark.parametrize("shape, ceilings, rates", [
    ("TpuV5E8", "MFU ceiling 65.6% with the kernels at 100% of the MXU, 60.4% with their matmuls at head dim 64's "
                "share of a 128-wide MXU (50%); in llm.c's count 61.3% and 56.4% (roofline estimates)",
     ((0.5e6, 0.7e6), (0.30e6, 0.45e6))),
    ("TpuV6E8", "MFU ceiling 48.2% with the kernels at 100% of the MXU, 41.7% with their matmuls at head dim 64's "
                "share of a 256-wide MXU (25%); in llm.c's count 45.0% and 39.0% (roofline estimates)",
     ((1.7e6, 2.6e6), None)),
])
def test_plan_gives_the_head_dim_aware_and_llmc_ceilings_and_plans_at_a_share_of_the_expected_kernels(
        monkeypatch, tmp_path, shape, ceilings, rates):
    import scripts.tpu_compile_step as tpu_compile

    monkeypatch.setattr(tpu_compile, "compile_step", lambda settings, tpu, log, attention: STEPS[shape][attention])
    monkeypatch.setattr(tpu_compile, "compiler_python", lambda: Path("/venv-tpu/bin/python"))
    raw = example_config("chain-gpt2-124m.json")
    cfg = config_from_dict({**{k: v for k, v in raw.items() if not k.startswith("_")}, "accelerator": shape})
    lines: list[str] = []
    plan = print_plan(cfg, log=lines.append, with_quota=False, measured_path=tmp_path / "none.json")
    (compiled,) = [line for line in lines if line.startswith("compiled    ")]
    assert ceilings in compiled
    assert GPT2_FLOPS_LLMC / GPT2_FLOPS * 0.656 == pytest.approx(0.6128, abs=1e-4)  # 61.3%: the figure
    # The planning rate: the share of the splash step's head-dim-aware ceiling, over the board's peak.
    board = 8 * (197e12 if shape == "TpuV5E8" else 918e12)
    splash = STEPS[shape]["splash"]["mfu_ceiling_mxu"]
    assert plan["tokens_per_s"] == pytest.approx(board * PLAN_CEILING_SHARE * splash / GPT2_FLOPS)
    low, high = rates[0]  # inside the review's estimate (issue 55)
    assert low <= plan["tokens_per_s"] <= high
    sdpa = board * PLAN_CEILING_SHARE * STEPS[shape]["sdpa"]["mfu_ceiling"] / GPT2_FLOPS
    assert plan["sdpa_tokens_per_s"] == pytest.approx(sdpa)
    if rates[1]:
        assert rates[1][0] <= plan["sdpa_tokens_per_s"] <= rates[1][1]
    (throughput,) = [line for line in lines if line.startswith("throughput  ")]
    generation = "v5e" if shape == "TpuV5E8" else "v6e"
    assert throughput == (
        f"throughput  {plan['tokens_per_s']:,.0f} tokens/s on {shape}: estimate: 55% of the splash step's compiled MFU "
        f"ceiling {splash:.1%} (its kernels at the head dim's MXU share) = {0.55 * splash:.1%} MFU of 8 x "
        f"{board / 8e12:g} TFLOP/s bf16 ({generation}); {sdpa:,.0f} tokens/s if a session falls back to SDPA (55% of "
        f"its {STEPS[shape]['sdpa']['mfu_ceiling']:.1%}); not measured: run --smoke first")
    # The fallbacks' clauses: flash with both of its ceilings, SDPA (no Pallas kernel) with its one.
    flash = STEPS[shape]["flash"]
    assert (f"flash at micro-batch {flash['micro_batch']}: 7.8 GiB, MFU ceiling {flash['mfu_ceiling']:.1%} "
            f"({flash['mfu_ceiling_mxu']:.1%} head-dim-aware); if the flash probe fails, SDPA") in compiled


def test_an_sdpa_step_has_one_ceiling_and_no_fallback_rate(monkeypatch, tmp_path):
    # gpt2-demo's 32 tokens: neither Pallas kernel tiles them, the session runs SDPA, the plan's rate is its share.
    import scripts.tpu_compile_step as tpu_compile

    sdpa = {**_report("sdpa", 0.1, None, 128, 8), "preset": "tiny"}
    monkeypatch.setattr(tpu_compile, "compile_step", lambda settings, tpu, log, attention: sdpa)
    monkeypatch.setattr(tpu_compile, "compiler_python", lambda: Path("/venv-tpu/bin/python"))
    raw = example_config("chain-demo.json")
    cfg = config_from_dict({k: v for k, v in raw.items() if not k.startswith("_")})
    lines: list[str] = []
    plan = print_plan(cfg, log=lines.append, with_quota=False, measured_path=tmp_path / "none.json")
    (compiled,) = [line for line in lines if line.startswith("compiled    ")]
    model = cfg.train.config.model.shape
    llmc = 0.1 * model.flops_per_token_llmc() / model.flops_per_token()
    assert compiled.endswith(f"MFU ceiling 10.0%, {llmc:.1%} in llm.c's count (roofline estimate)")
    assert plan["tokens_per_s"] == pytest.approx(8 * 197e12 * PLAN_CEILING_SHARE * 0.1 / model.flops_per_token())
    assert plan["sdpa_tokens_per_s"] is None
    assert "falls back" not in plan["tokens_per_s_source"]
