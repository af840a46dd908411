"""The train step compiled for Kaggle's TPUs by libtpu's compile-only client (scripts/tpu_compile.py, in .venv-tpu
as scripts/setup.sh makes it): tiny's step, with the Pallas flash-attention kernel, fits v5e-8 and v6e-8 with the
compiler's figures agreeing with what the step holds and computes, and with jax's splash attention in no more HBM;
a micro-batch far too large does not fit v5e-8, and --plan refuses that chain in one line before anything is pushed
(shown on tiny's step at a micro-batch of 512 sequences a chip: the same refusal, compiled in about a minute
instead of gpt2's six)."""

from __future__ import annotations

import json
import re

import pytest
from helpers import REPO, error_lines, run_script, train_config

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (REPO / ".venv-tpu" / "bin" / "python").exists(),
                                                   reason="no .venv-tpu: run bash scripts/setup.sh")]
COMPILER = {"TPU_COMPILER_PYTHON": ""}  # the suite turns it off (conftest.py); these tests use .venv-tpu's


def test_tinys_step_compiles_for_v5e_8_and_v6e_8_in_line_with_the_step_and_the_same_when_compiled_elsewhere(tmp_path):
    env = {**COMPILER, "TPU_COMPILE_CACHE": str(tmp_path / "cache")}
    args = ("--preset", "tiny", "--micro-batch", "16", "--total-batch-tokens", "8192", "--attention", "flash", "--tpu",
            "all")
    proc = run_script("scripts/tpu_compile.py", *args, "--json", env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout)
    assert [(r["tpu"], r["device_kind"], r["devices"]) for r in reports] == [
        ("v5e-8", "TPU v5 lite", 8), ("v6e-8", "TPU v6 lite", 8)]
    assert [r["versions"] for r in reports] == [{"jax": "0.7.2", "libtpu": "0.0.17"}] * 2  # Kaggle's image's pins
    cfg = train_config(preset="tiny", micro_batch=16, total_batch_tokens=8192)
    params = cfg.model.shape.num_params()
    for r, hbm_gib in zip(reports, (16, 32), strict=True):
        # The step a session runs where its flash probe passes: the Pallas kernel lowered for the TPU here, at the
        # Mosaic version libtpu 0.0.17 reads (jax would serialize a newer one), one forward and two backward
        # kernels a layer a micro-step.
        assert (r["micro_batch"], r["grad_accum_steps"], r["attention"]) == (16, 2, "pallas-flash")
        assert r["mosaic_version"] == 4 and r["kernel_calls"] == 3 * cfg.model.shape.n_layer * 2
        assert r["hbm_bytes"] == hbm_gib * 2**30 and 0 < r["peak_bytes"] < r["hbm_bytes"] and r["fits"]
        memory = r["memory"]
        # Replicated over the chips: each holds the fp32 weights and both AdamW moments (and the token batch),
        # and every updated one is donated, as torch_xla donates them.
        assert 3 * 4 * params <= memory["arguments"] <= 3 * 4 * params * 1.05
        assert memory["aliased"] >= 3 * 4 * params
        # The compiler's own total (its memory-usage report) holds the arguments, and is the figure that decides.
        assert memory["arguments"] < memory["compiler_total"] == r["peak_bytes"]
        # The step's matmul FLOPs per chip, counted in the optimized HLO with the loop's 2 trips: 6N + 12LCT a token
        # (6N counts the position embedding and the LayerNorms as matmul weights: the HLO has a little less).
        # The kernels' FLOPs are opaque to the HLO: what it counts is the model's less attention's 12LCT.
        assert r["model_flops"] == cfg.model.shape.flops_per_token() * 8192 / 8
        attention = 12 * cfg.model.shape.n_layer * cfg.model.shape.n_embd * cfg.model.shape.block_size * 8192 / 8
        assert 0.97 * (r["model_flops"] - attention) <= r["flops"] <= 1.03 * (r["model_flops"] - attention)
        assert r["kernel_flops"] == attention
        assert r["loops"] == [2]
        # Every gradient is all-reduced once a step (bf16 or fp32), after the accumulation loop: none inside it,
        # where it would run every micro-step (the tied wte's two parts included: shared/runtime/accum_loop.py).
        inside = [g for g in r["collectives"] if g["where"] == "inside"]
        outside = sum(g["bytes"] for g in r["collectives"] if g["where"] == "outside" and g["kind"] == "all-reduce")
        assert inside == [] and outside >= 2 * params
        assert 0 < r["mfu_ceiling"] < 1 and r["step_s"] > r["roofline_ops_s"] > 0
    # The step a session tries first: jax's splash attention through call_jax (shared/model/splash.py), lowered for
    # the TPU here too. Two kernels a layer a micro-step (the forward, saving its logsumexp, and the fused backward
    # reading it: the forward is not run again), and no more HBM than the flash step's.
    splash = run_script("scripts/tpu_compile.py", *args[:-1], "v6e-8", "--attention", "splash", "--json", env=env,
                        timeout=900)
    assert splash.returncode == 0, splash.stderr[-3000:]
    (s,) = json.loads(splash.stdout)
    assert (s["attention"], s["mosaic_version"], s["micro_batch"]) == ("pallas-splash", 4, 16)
    assert s["kernel_calls"] == 2 * cfg.model.shape.n_layer * 2 and s["fits"]
    assert s["peak_bytes"] <= reports[1]["peak_bytes"] and s["kernel_flops"] == reports[1]["kernel_flops"]
    assert [g for g in s["collectives"] if g["where"] == "inside"] == []
    # The lines scripts read, then the same again from the cache.
    again = run_script("scripts/tpu_compile.py", *args, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(r"^HBM per chip: \d+\.\d GiB of 16 GiB \(fits, \d+% free\)$", again.stdout, re.M)
    assert re.search(r"^HBM per chip: \d+\.\d GiB of 32 GiB \(fits, \d+% free\)$", again.stdout, re.M)
    assert len(re.findall(r"^all-reduce inside the loop: \d+, \d+\.\d MB per micro-step$", again.stdout, re.M)) == 2
    assert len(re.findall(r"^MFU ceiling: \d+\.\d%$", again.stdout, re.M)) == 2
    assert again.stdout.count("(cached)") == 2 and "compiling" not in again.stderr
    # Traced here with --trace-only, compiled "elsewhere" by the command it prints (the same .venv-tpu here), read
    # back with --analyse: the figures of the direct compile (how gpt2-xl's steps were compiled on a larger machine).
    traced = run_script("scripts/tpu_compile.py", *args[:-1], "v5e-8", "--trace-only", str(tmp_path / "t"), env=env,
                        timeout=600)
    assert traced.returncode == 0 and traced.stdout == "", traced.stderr[-3000:]
    command = re.search(r"compile it where memory allows with: python (scripts/tpu_compile_libtpu.py .+)$",
                        traced.stderr, re.M).group(1).split()
    assert command[1:] == [str(tmp_path / "t" / "v5e-8"), "v5e:2x4", "2,4,1"]
    compiled = run_script(command[0], *command[1:], python=str(REPO / ".venv-tpu" / "bin" / "python"), timeout=600)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    read = run_script("scripts/tpu_compile.py", "--tpu", "all", "--analyse", str(tmp_path / "t"), "--json", env=env)
    assert read.returncode == 0, read.stderr[-3000:]
    (elsewhere,) = json.loads(read.stdout)
    assert (elsewhere["tpu"], elsewhere["micro_batch"]) == ("v5e-8", 16)
    for key in ("peak_bytes", "fits", "flops", "hbm_traffic", "collectives", "kernel_calls"):
        assert elsewhere[key] == reports[0][key], key
    missing = run_script("scripts/tpu_compile.py", "--analyse", str(tmp_path / "none"), env=env)
    assert missing.returncode == 2 and error_lines(missing.stderr) == [
        f"error: no compiled step under {tmp_path / 'none'}/<tpu>/ for v5e-8"]


def test_a_micro_batch_far_too_large_does_not_fit_v5e_8_and_plan_refuses_it_in_one_line(tmp_path):
    env = {**COMPILER, "TPU_COMPILE_CACHE": str(tmp_path / "cache")}
    config = tmp_path / "chain.json"
    config.write_text(json.dumps({"name": "too-big", "user": "alice", "total_steps": 100,
                                  "token_datasets": ["alice/tokens"], "accelerator": "TpuV5E8",
                                  "train": {"preset": "tiny", "seq_len": 1024, "micro_batch": 4096,
                                            "total_batch_tokens": 8 * 2**20}}))
    # The splash step, which --plan compiles first (a session tries it first): plan then reads it from the cache.
    proc = run_script("scripts/tpu_compile.py", "--config", str(config), "--attention", "splash", "--json", env=env,
                      timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (report,) = json.loads(proc.stdout)
    assert (report["tpu"], report["micro_batch"], report["fits"], report["attention"]) == (
        "v5e-8", 4096, False, "pallas-splash")
    # The compiler refused it itself, with its figures: what the step needs against what a v5e chip offers it.
    assert report["peak_bytes"] > report["hbm_bytes"] and 15 * 2**30 <= report["hbm_bytes"] <= 16 * 2**30
    assert "Ran out of memory in memory space hbm" in report["compiler_says"]
    plan = run_script("scripts/chain_sessions.py", "--config", str(config), "--plan", env=env, timeout=300)
    assert plan.returncode == 2, plan.stdout[-2000:]
    assert error_lines(plan.stderr) == [
        f"error: the train step does not fit v5e-8's HBM: {report['peak_bytes'] / 2**30:.1f} GiB of 16 GiB per chip "
        "(the TPU compiler's figure; tiny, micro-batch 4096, the splash step); "
        "lower train.micro_batch (or leave it auto), set train.activation_checkpointing \"on\", or set train.fsdp true"]
    assert "plan for chain" not in plan.stdout  # refused before the plan is printed



PLAN_ENV = {**COMPILER, "TPU_COMPILE_CACHE": "", "KAGGLE_USERNAME": "", "KAGGLE_KEY": ""}


def test_plan_of_the_demo_config_as_a_user_runs_it_compiles_the_sdpa_step_its_32_token_sessions_run(tmp_path):
    # A fresh HOME (no compile cache), the compiler on: neither Pallas kernel tiles 32 tokens, so a session runs
    # SDPA, and that is the one step compiled (tracing flash there failed: "sub got incompatible shapes").
    env = {**PLAN_ENV, "HOME": str(tmp_path), "KAGGLE_CONFIG_DIR": str(tmp_path / "kaggle")}
    proc = run_script("scripts/chain_sessions.py", "--config", "examples/chain-demo.json", "--plan", env=env,
                      timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("compiled    ")]
    assert re.fullmatch(r"compiled    v5e-8 by libtpu 0\.0\.17 \(the SDPA step, what a session runs at T=32: the "
                        r"splash and flash kernels' blocks do not tile it, micro-batch 8\): HBM per chip \d+\.\d GiB "
                        r"of 16 GiB \(\d+% free\); all-reduce inside the loop 0, 0\.0 MB per micro-step; MFU ceiling "
                        r"\d+\.\d%, \d+\.\d% in llm\.c's count \(roofline estimate\)", line), line
    assert proc.stderr.count("tracing the step for v5e-8") == 1
    assert (tmp_path / ".cache" / "gpt2-on-kaggle" / "tpu-compile").is_dir()  # the user's own cache


def test_plan_of_a_128_token_config_compiles_splash_then_its_flash_and_sdpa_fallbacks(tmp_path):
    # The shortest length both Pallas kernels tile: the three steps a session may train with, each compiled.
    config = tmp_path / "chain.json"
    config.write_text(json.dumps({"name": "tiny-128", "user": "alice", "total_steps": 100,
                                  "token_datasets": ["alice/tokens"], "accelerator": "TpuV5E8",
                                  "train": {"preset": "tiny", "seq_len": 128, "micro_batch": "auto",
                                            "total_batch_tokens": 16384}}))
    env = {**PLAN_ENV, "HOME": str(tmp_path), "KAGGLE_CONFIG_DIR": str(tmp_path / "kaggle")}
    proc = run_script("scripts/chain_sessions.py", "--config", str(config), "--plan", env=env, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("compiled    ")]
    assert line.startswith("compiled    v5e-8 by libtpu 0.0.17 (the splash step, micro-batch 128): HBM per chip "), line
    fallbacks = (r"; if the splash probe fails, flash at micro-batch 128: \d+\.\d GiB, MFU ceiling \d+\.\d% "
                 r"\(\d+\.\d% head-dim-aware\); if the flash probe fails, SDPA at micro-batch 128: \d+\.\d GiB, MFU "
                 r"ceiling \d+\.\d%$")
    assert re.search(fallbacks, line), line
    assert proc.stderr.count("tracing the step for v5e-8") == 3


def test_plan_of_the_gpt2_chain_gives_the_head_dim_aware_and_llmc_ceilings_and_plans_at_a_share_of_splashs(tmp_path):
    # A fresh HOME, the compiler on, examples/chain-gpt2-124m.json as a user plans it: gpt2's splash, flash and SDPA
    # steps compiled for v5e-8 (about 10 minutes each on a loaded 2-core machine). The figures of
    # docs/tpu-throughput.md ("The kernels at their MXU share"): 65.6% with the kernels at 100% of the MXU, 60.4%
    # at head dim 64's half of it; in llm.c's count (6N + 6LCT) 61.3% and 56.4%. SDPA's step, at micro-batch 64, is
    # a third (33.7% on 2026-11-28; 33.0% in the docs' older rows).
    env = {**PLAN_ENV, "HOME": str(tmp_path), "KAGGLE_CONFIG_DIR": str(tmp_path / "kaggle")}
    proc = run_script("scripts/chain_sessions.py", "--config", "examples/chain-gpt2-124m.json", "--plan", env=env,
                      timeout=5400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    (line,) = [line for line in lines if line.startswith("compiled    ")]
    assert line.startswith("compiled    v5e-8 by libtpu 0.0.17 (the splash step, micro-batch 128): HBM per chip "), line
    assert ("; MFU ceiling 65.6% with the kernels at 100% of the MXU, 60.4% with their matmuls at head dim 64's share "
            "of a 128-wide MXU (50%); in llm.c's count 61.3% and 56.4% (roofline estimates); if the splash probe "
            "fails, flash at micro-batch 128: ") in line, line
    sdpa_clause = r"; if the flash probe fails, SDPA at micro-batch 64: \d+\.\d GiB, MFU ceiling (3\d\.\d)%$"
    sdpa_ceiling = float(re.search(sdpa_clause, line).group(1)) / 100
    # The rate planned with: 55% of splash's 60.4% over 8 x 197 TFLOP/s and gpt2's 860,101,632 FLOPs a token, about
    # 0.61M tokens/s; SDPA's 55% of its ceiling beside it, about 0.33M (the review's 0.5-0.7M and 0.30-0.45M).
    (throughput,) = [line for line in lines if line.startswith("throughput  ")]
    found = re.fullmatch(r"throughput  ([\d,]+) tokens/s on TpuV5E8: estimate: 55% of the splash step's compiled MFU "
                         r"ceiling 60\.4% \(its kernels at the head dim's MXU share\) = 33\.2% MFU of 8 x 197 TFLOP/s "
                         r"bf16 \(v5e\); ([\d,]+) tokens/s if a session falls back to SDPA \(55% of its "
                         rf"{sdpa_ceiling:.1%}\); not measured: run --smoke first", throughput)
    assert found, throughput
    rate, sdpa = (int(group.replace(",", "")) for group in found.groups())
    assert 600_000 <= rate <= 615_000  # 0.55 x 60.4% x 1,576 TFLOP/s / 860.1M FLOPs: 608,700 within rounding
    assert sdpa == pytest.approx(8 * 197e12 * 0.55 * sdpa_ceiling / 860_101_632, rel=2e-3)
    assert 300_000 <= sdpa <= 450_000
