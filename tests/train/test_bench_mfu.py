"""scripts/bench_mfu.py: the FLOPs-per-token formula against a hand count, and a short CPU run end to end."""

import importlib.util

import pytest
from helpers import REPO, run_script, train_config

from shared.model.model import GPT


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_mfu", REPO / "scripts" / "bench_mfu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flops_per_token_gpt2_hand_count():
    # gpt2 with the vocabulary padded to 50304: wte 50304*768 + wpe 1024*768 + 12 blocks + ln_f.
    block = (2 * 768) + (768 * 2304 + 2304) + (768 * 768 + 768) + (2 * 768) + (768 * 3072 + 3072) + (3072 * 768 + 768)
    n = 50304 * 768 + 1024 * 768 + 12 * block + 2 * 768
    assert n == 124_475_904 == GPT(train_config(preset="gpt2").model.shape).num_params()
    fpt = load_bench().flops_per_token(n, n_layer=12, n_embd=768, seq_len=1024)
    assert fpt == 6 * 124_475_904 + 12 * 12 * 768 * 1024 == 860_101_632



def test_the_bench_reads_the_chains_train_settings_in_either_shape_the_file_writes(tmp_path, monkeypatch):
    # The shipped example writes its train settings by section; a config may also give them under `settings`, as
    # tokenize and eval do (scripts/chain/config.py): the bench's default step is the chain's either way.
    import json

    bench = load_bench()
    shipped = bench.chain_train_settings()
    assert shipped["preset"] == "gpt2" and shipped["micro_batch"] == "auto" and "optim" not in shipped
    raw = json.loads(bench.CHAIN_CONFIG.read_text())
    config = tmp_path / "chain.json"
    config.write_text(json.dumps({**raw, "train": {"settings": shipped}}))
    monkeypatch.setattr(bench, "CHAIN_CONFIG", config)
    assert bench.chain_train_settings() == shipped

@pytest.mark.slow
def test_cpu_run_prints_table_and_notice():
    proc = run_script("scripts/bench_mfu.py", "--backend", "cpu", "--preset", "tiny", "--seq-len", "64",
                      "--steps", "2", "--warmup", "1", "--log-every", "1", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "MFU is meaningless on CPU; figures only show the script runs" in out
    assert "project trainer (eager)" in out and "plain PyTorch reference (eager" in out
    assert "trainer / reference tokens/s:" in out


@pytest.mark.slow
def test_xla_run_reports_one_graph_step_with_accumulation():
    # The production step structure: accumulation, logging every few steps; the script reports graphs,
    # host syncs and compilations per optimizer step next to tokens/s.
    proc = run_script("scripts/bench_mfu.py", "--backend", "xla", "--preset", "tiny", "--seq-len", "32",
                      "--accum", "3", "--steps", "4", "--warmup", "4", "--log-every", "2", "--skip-reference",
                      timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "micro-batch 1 per device x 3 micro-steps per optimizer step" in proc.stdout
    # One graph per step, no device wait (counted by wrapping torch_xla's), the three logged scalars every other
    # step; the timing line's figures are measurements, so only its presence is checked.
    assert ("trainer per optimizer step (3 micro-steps): 1.00 graphs executed, 0.00 device waits, 1.50 "
            "device-to-host transfers, 0 compilations during the 4 measured steps") in proc.stdout
    assert "trainer timing per step: host trace " in proc.stdout
