"""Which attention kernels a session tries, in order, is one decision (shared/train/attention.py): the table of
TPU generation x sequence length x switches, and the session's runtime (`XlaRuntime.select_attention`, its probes
faked) and the step tracer (`TraceRuntime.select_attention`, which --plan's compiles run) following it."""

from __future__ import annotations

import types

import pytest

from shared.tpu import TPU_GENERATIONS
from shared.train.attention import attention_candidates, flash_fits, splash_fits, untiled_kernels

S, F, D = "pallas-splash", "pallas-flash", "sdpa"
# Where each Pallas kernel's blocks tile the sequence: splash's 512 (or T below it) a multiple of 128 dividing T;
# flash's key blocks of min(512, T) and min(256, T) multiples of 128 and its 256/512/1024 blocks dividing T.
TILED = {32: "", 64: "", 128: "SF", 192: "", 256: "SF", 384: "S", 512: "SF", 640: "", 768: "", 1024: "SF",
         1536: "S", 2048: "SF", 3072: "SF"}
SWITCHES = {"": {}, "splash off": {"GPT2K_SPLASH_ATTENTION": "0"}, "flash off": {"GPT2K_FLASH_ATTENTION": "0"},
            "both on": {"GPT2K_SPLASH_ATTENTION": "1", "GPT2K_FLASH_ATTENTION": "1"}}
GENERATIONS = (None, "v2", "v3", "v4", "v5e", "v5p", "v6e")


def expected(generation: str | None, seq_len: int, switches: str) -> tuple[str, ...]:
    if generation in (None, "v2", "v3") or switches == "flash off":  # no Pallas kernel: SDPA
        return (D,)
    tiled = TILED[seq_len].replace("S", "" if switches == "splash off" else "S")
    return tuple({"S": S, "F": F}[k] for k in tiled) + (D,)


def test_the_kernels_blocks_tile_the_lengths_of_the_table():
    for seq_len, tiled in TILED.items():
        assert (splash_fits(seq_len), flash_fits(seq_len)) == ("S" in tiled, "F" in tiled), seq_len
    assert untiled_kernels("v5e", 32) == ["splash", "flash"] and untiled_kernels("v5e", 384) == ["flash"]
    assert untiled_kernels("v3", 32) == [] and untiled_kernels("v5e", 32, {"GPT2K_SPLASH_ATTENTION": "0"}) == ["flash"]


@pytest.mark.parametrize("switches", SWITCHES)
def test_the_candidates_over_generation_and_sequence_length(switches):
    for generation in GENERATIONS:
        for seq_len in TILED:
            got = attention_candidates(generation, seq_len, env=SWITCHES[switches])
            assert got == expected(generation, seq_len, switches), (generation, seq_len)
            # A second selection (auto's micro-batch) starts from the kernel the first kept.
            assert attention_candidates(generation, seq_len, F, SWITCHES[switches]) == tuple(
                k for k in got if k != S)
            assert attention_candidates(generation, seq_len, D, SWITCHES[switches]) == (D,)


def _kernels(monkeypatch, runtime, probed: list[str], passing: str):
    def flash(q, k, v):
        raise AssertionError("not run: the probe is faked")

    def splash(q, k, v):
        raise AssertionError("not run: the probe is faked")

    def probe(name, kernel, *args, **kwargs):
        probed.append(name)
        return name == passing

    monkeypatch.setattr(runtime, "_flash_attention_kernel", lambda: flash)
    monkeypatch.setattr(runtime, "_splash_attention_kernel", lambda *args: splash)
    monkeypatch.setattr(runtime, "_passes_probe", probe)


@pytest.mark.parametrize("switches", SWITCHES)
def test_the_session_probes_the_candidates_in_order_and_keeps_the_first_that_passes(xla_runtime, monkeypatch,
                                                                                  switches):
    import shared.train.model as model

    for name, value in SWITCHES[switches].items():
        monkeypatch.setenv(name, value)
    try:
        for generation in GENERATIONS:
            monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS.get(generation or ""))
            for seq_len in TILED:
                want = expected(generation, seq_len, switches)
                pallas = [k.removeprefix("pallas-") for k in want[:-1]]
                probed: list[str] = []
                _kernels(monkeypatch, xla_runtime, probed, passing="")  # every probe fails
                xla_runtime.select_attention(8, 2, seq_len, 64)
                assert (probed, xla_runtime.attention) == (pallas, D), (generation, seq_len)
                for passing in pallas:  # the first that passes is kept, none after it probed
                    probed = []
                    _kernels(monkeypatch, xla_runtime, probed, passing)
                    xla_runtime.select_attention(8, 2, seq_len, 64)
                    assert probed == pallas[:pallas.index(passing) + 1], (generation, seq_len)
                    assert xla_runtime.attention == f"pallas-{passing}" and model._attention_len == seq_len
    finally:
        model.set_attention_kernel(None)


@pytest.mark.parametrize("switches", SWITCHES)
def test_the_step_tracer_traces_the_first_candidate(monkeypatch, switches):
    import shared.train.model as model
    import shared.train.step_trace as step_trace

    lowered = []
    monkeypatch.setattr(step_trace, "lower_pallas_for_tpu", lambda: lowered.append(True))
    for name, value in SWITCHES[switches].items():
        monkeypatch.setenv(name, value)
    try:
        for generation in GENERATIONS:
            for seq_len in TILED:
                lowered.clear()
                tracer = types.SimpleNamespace(tpu_generation=TPU_GENERATIONS.get(generation or "") or
                                               types.SimpleNamespace(name=generation),
                                               _flash_attention_kernel=lambda: "flash",
                                               _splash_attention_kernel=lambda *args: "splash")
                step_trace.TraceRuntime.select_attention(tracer, 8, 2, seq_len, 64)
                first = expected(generation, seq_len, switches)[0]
                assert tracer.attention == first, (generation, seq_len)
                assert lowered == ([True] if first != D else [])  # a Pallas kernel is lowered for the TPU
                assert model._attention_fn == {S: "splash", F: "flash", D: None}[first]
    finally:
        model.set_attention_kernel(None)
