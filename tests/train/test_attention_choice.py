"""Which attention kernels a session tries, in order, is one decision (shared/model/attention.py): the table of
TPU generation x sequence length x the `attention` setting, and the session's runtime (`XlaRuntime.select_attention`,
its probes faked, with the micro-batch auto picks then), the step tracer (`TraceRuntime.select_attention`, which
--plan's compiles run), --plan's micro-batch, the compile tool's traced kernel and bench_mfu's default step following
it; and the loop that tries them (`choose`), with fake kernels and probes."""

from __future__ import annotations

import types

import pytest
from helpers import train_config

import shared.runtime.attention_select as attention_select
from shared.config import TrainConfig
from shared.errors import UserError
from shared.model.attention import (
    FIRST_KERNEL,
    SDPA_CHOICE,
    SETTING_OF,
    candidates,
    flash_fits,
    splash_fits,
    untiled_kernels,
)
from shared.tpu import TPU_GENERATIONS
from shared.train_sections import ATTENTION_SETTINGS

S, F, D = "pallas-splash", "pallas-flash", "sdpa"
# Where each Pallas kernel's blocks tile the sequence: splash's 512 (or T below it) a multiple of 128 dividing T;
# flash's key blocks of min(512, T) and min(256, T) multiples of 128 and its 256/512/1024 blocks dividing T.
TILED = {32: "", 64: "", 128: "SF", 192: "", 256: "SF", 384: "S", 512: "SF", 640: "", 768: "", 1024: "SF",
         1536: "S", 2048: "SF", 3072: "SF"}
GENERATIONS = (None, "v2", "v3", "v4", "v5e", "v5p", "v6e")


def expected(generation: str | None, seq_len: int, setting: str) -> tuple[str, ...]:
    if generation in (None, "v2", "v3") or setting == "sdpa":  # no Pallas kernel: SDPA
        return (D,)
    tiled = TILED[seq_len].replace("S", "" if setting == "flash" else "S")
    return tuple({"S": S, "F": F}[k] for k in tiled) + (D,)


def test_the_settings_words_are_the_kernels_in_the_order_tried():
    assert tuple(FIRST_KERNEL) == ATTENTION_SETTINGS == ("auto", "splash", "flash", "sdpa")
    assert TrainConfig().step.attention == "auto"
    with pytest.raises(UserError, match="^--attention must be auto, splash, flash or sdpa, got 'pallas-flash'$"):
        train_config(attention="pallas-flash")


def test_the_kernels_blocks_tile_the_lengths_of_the_table():
    for seq_len, tiled in TILED.items():
        assert (splash_fits(seq_len), flash_fits(seq_len)) == ("S" in tiled, "F" in tiled), seq_len
    assert untiled_kernels("v5e", 32) == ["splash", "flash"] and untiled_kernels("v5e", 384) == ["flash"]
    assert untiled_kernels("v3", 32) == [] and untiled_kernels("v5e", 32, "flash") == ["flash"]
    assert untiled_kernels("v5e", 32, "sdpa") == []


@pytest.mark.parametrize("setting", ATTENTION_SETTINGS)
def test_the_candidates_over_generation_and_sequence_length(setting):
    for generation in GENERATIONS:
        for seq_len in TILED:
            got = candidates(generation, seq_len, setting)
            assert got == expected(generation, seq_len, setting), (generation, seq_len)
            # A second selection (auto's micro-batch) starts from the kernel the first kept, passed as its setting.
            for i, kept in enumerate(got):
                assert candidates(generation, seq_len, SETTING_OF[kept]) == got[i:], (generation, seq_len, kept)


def test_the_session_plan_compile_tool_and_bench_pick_the_same_step(xla_runtime, monkeypatch):
    # The session's kernel and micro-batch (its probes all passing), --plan's micro-batch (the first kernel's), the
    # compile tool's traced kernel and bench_mfu's default step, each over generation x length x setting, against
    # the table.
    from scripts.bench_mfu import chain_step
    from scripts.chain.config import config_from_dict
    from scripts.chain.plan import planned_train
    from scripts.tpu_compile_step import traced_attention
    from shared.runtime.step import select_attention_and_micro_batch
    from shared.tpu import micro_batch_for

    assert xla_runtime.num_devices == 8  # as the v5e-8 and v6e-8 machines
    _kernels(monkeypatch, [], passing=("splash", "flash"))

    for setting in ATTENTION_SETTINGS:
        for generation, accelerator in (("v5e", "TpuV5E8"), ("v6e", "TpuV6E8")):
            for seq_len in (64, 256, 1024):  # lengths dividing the gpt2 chain's batch, which chain_step keeps
                first = expected(generation, seq_len, setting)[0]
                train = {"preset": "gpt2", "seq_len": seq_len, "micro_batch": "auto", "attention": setting}
                assert traced_attention(train, generation) == first, (setting, generation, seq_len)
                cfg = TrainConfig.from_dict(train)
                want = micro_batch_for(cfg, generation, first, 8)
                planned, _ = planned_train(config_from_dict({"accelerator": accelerator, "train": train,
                                                                "token_datasets": ["a/b"]}))
                assert planned.step.micro_batch == want, (setting, generation, seq_len)
                assert chain_step(8, seq_len, generation, setting)[0] == want // 8
                monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS[generation])
                session, choice = select_attention_and_micro_batch(cfg, xla_runtime, log=lambda line: None)
                assert (choice.kind, session.step.micro_batch) == (first, want), (setting, generation, seq_len)


def _kernels(monkeypatch, probed: list[str], passing: tuple[str, ...]):
    def flash(q, k, v):
        raise AssertionError("not run: the probe is faked")

    def splash(q, k, v):
        raise AssertionError("not run: the probe is faked")

    def probe(self, name, kernel, *args, **kwargs):
        probed.append(name)
        return None if name in passing else "it differs from SDPA"

    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: flash)
    monkeypatch.setattr(attention_select, "splash_attention_kernel", lambda *args: splash)
    monkeypatch.setattr(attention_select.MeshProbes, "probe", probe)


@pytest.mark.parametrize("setting", ATTENTION_SETTINGS)
def test_the_session_probes_the_candidates_in_order_and_keeps_the_first_that_passes(xla_runtime, monkeypatch,
                                                                                  setting):
    for generation in GENERATIONS:
        monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS.get(generation or ""))
        for seq_len in TILED:
            want = expected(generation, seq_len, setting)
            pallas = [k.removeprefix("pallas-") for k in want[:-1]]
            probed: list[str] = []
            _kernels(monkeypatch, probed, passing=())  # every probe fails
            choice = xla_runtime.select_attention(8, 2, seq_len, 64, setting)
            assert (probed, choice.kind) == (pallas, D), (generation, seq_len)
            for passing in pallas:  # the first that passes is kept, none after it probed
                probed = []
                _kernels(monkeypatch, probed, (passing,))
                choice = xla_runtime.select_attention(8, 2, seq_len, 64, setting)
                assert probed == pallas[:pallas.index(passing) + 1], (generation, seq_len)
                assert (choice.kind, choice.seq_len) == (f"pallas-{passing}", seq_len)
                assert choice.qkv_layout == {"splash": "BHDT", "flash": "BHTD"}[passing]


@pytest.mark.parametrize("setting", ATTENTION_SETTINGS)
def test_the_step_tracer_traces_the_first_candidate(monkeypatch, setting):
    import shared.runtime.step_trace as step_trace

    lowered = []
    monkeypatch.setattr(step_trace, "lower_pallas_for_tpu", lambda: lowered.append(True))
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: "flash")
    monkeypatch.setattr(attention_select, "splash_attention_kernel", lambda *args: "splash")
    for generation in GENERATIONS:
        for seq_len in TILED:
            lowered.clear()
            tracer = types.SimpleNamespace(tpu_generation=TPU_GENERATIONS.get(generation or "") or
                                           types.SimpleNamespace(name=generation), mesh=None)
            choice = step_trace.TraceRuntime.select_attention(tracer, 8, 2, seq_len, 64, setting)
            first = expected(generation, seq_len, setting)[0]
            assert choice.kind == first, (generation, seq_len)
            assert lowered == ([True] if first != D else [])  # a Pallas kernel is lowered for the TPU
            assert choice.kernel == {S: "splash", F: "flash", D: None}[first]


class _Loop:
    """Fakes for shared/model/attention.py `choose`: kernels by name (None: it does not import), probe answers by
    the setting's word (None: passes; a line: why not; False: not probed), and what the loop asked and said."""

    def __init__(self, kernels: dict, answers: dict):
        self.kernels, self.answers, self.calls, self.started, self.lines = kernels, answers, [], [], []
        self.shapes = []

    def make(self, kind, instead):
        self.calls.append(("make", kind, instead))
        return self.kernels.get(kind)

    def probe(self, word, kernel, instead, shape):
        self.calls.append(("probe", word, kernel, instead))
        self.shapes.append((word, shape))
        answer = self.answers[word]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def choose(self, kinds=(S, F, D), probe=True, batch_for=None):
        from shared.model.attention import choose

        return choose(kinds, (16, 12, 1024, 64), self.make, self.probe if probe else None, start=self.started.append,
                      devices=8, log=self.lines.append, batch_for=batch_for)


WHERE = "at this session's shapes (2 sequences x 12 heads x 1024 tokens x 64 per device)"


def test_the_loop_keeps_the_second_kernel_where_the_first_fails_its_probe_and_says_why():
    loop = _Loop({F: "flash-kernel", S: "splash-kernel"}, {"splash": "it differs from SDPA: dv by 0.5", "flash": None})
    choice = loop.choose()
    assert (choice.kind, choice.kernel, choice.seq_len, choice.qkv_layout) == (F, "flash-kernel", 1024, "BHTD")
    assert loop.calls == [  # flash's (its jax) made first, then splash's; each probed in order
        ("make", F, "using SDPA"), ("make", S, "trying the flash-attention kernel"),
        ("probe", "splash", "splash-kernel", "trying the flash-attention kernel"),
        ("probe", "flash", "flash-kernel", "using SDPA")]
    assert loop.started == [["splash", "flash"]]
    assert loop.lines == [f"notice: the Pallas splash-attention kernel failed its probe {WHERE}: it differs from "
                          "SDPA: dv by 0.5; trying the flash-attention kernel"]


def test_the_loop_falls_back_to_sdpa_where_every_probe_fails_or_is_not_run():
    loop = _Loop({F: "flash-kernel", S: "splash-kernel"}, {"splash": "RuntimeError: Mosaic", "flash": "it differs"})
    assert loop.choose() == SDPA_CHOICE
    assert loop.lines == [
        f"notice: the Pallas splash-attention kernel failed its probe {WHERE}: RuntimeError: Mosaic; trying the "
        "flash-attention kernel",
        f"notice: the Pallas flash-attention kernel failed its probe {WHERE}: it differs; using SDPA"]
    # A probe not run (the budget spent: the probe said so) is no failure to say, and no pass.
    loop = _Loop({F: "flash-kernel", S: "splash-kernel"}, {"splash": "it differs", "flash": False})
    assert loop.choose() == SDPA_CHOICE and len(loop.lines) == 1 and loop.lines[0].startswith("notice: the Pallas s")


def test_the_loop_tries_no_kernel_without_flashs_jax_and_skips_one_that_does_not_import():
    loop = _Loop({S: "splash-kernel"}, {})  # flash's jax does not import: no splash either, no probe
    assert loop.choose() == SDPA_CHOICE
    assert (loop.calls, loop.started, loop.lines) == ([("make", F, "using SDPA")], [], [])
    loop = _Loop({F: "flash-kernel"}, {"flash": None})  # splash's torchax does not: flash is probed
    assert loop.choose().kind == F and loop.started == [["flash"]]
    assert [call[:2] for call in loop.calls] == [("make", F), ("make", S), ("probe", "flash")]
    loop = _Loop({F: "flash-kernel", S: "splash-kernel"}, {})
    assert loop.choose((D,)) == SDPA_CHOICE and loop.calls == []  # SDPA alone: nothing made
    loop = _Loop({F: "flash-kernel", S: "splash-kernel"}, {})  # (splash, SDPA): flash's jax made all the same
    assert loop.choose((S, D), probe=False).kernel == "splash-kernel"
    assert loop.calls == [("make", F, "using SDPA"), ("make", S, "using SDPA")]


def test_the_loop_keeps_the_first_kernel_made_without_a_probe_and_stops_on_a_probe_that_hangs():
    loop = _Loop({F: "flash-kernel", S: None}, {})  # the step tracer's: no probe
    choice = loop.choose(probe=False)
    assert (choice.kind, choice.kernel, loop.started) == (F, "flash-kernel", [["flash"]])
    from shared.runtime.attention_probe import ProbeHung

    hung = ProbeHung("stopping before training: the splash-attention kernel's probe gave no answer")
    loop = _Loop({F: "flash-kernel", S: "splash-kernel"}, {"splash": hung, "flash": None})
    with pytest.raises(ProbeHung, match="^stopping before training: the splash-attention"):
        loop.choose()
    assert loop.calls[-1][:2] == ("probe", "splash") and loop.lines == []


def test_the_loop_probes_each_kernel_once_at_the_micro_batch_it_would_train_at():
    # auto's micro-batch: splash's 128, flash's 64 (docs/tpu-throughput.md's v5e-8 gpt2 rows): each probed at its own,
    # and the failure said at the shapes it was probed at.
    loop = _Loop({F: "flash-kernel", S: "splash-kernel"}, {"splash": "it differs", "flash": None})
    choice = loop.choose(batch_for={S: 128, F: 64, D: 64}.__getitem__)
    assert choice.kind == F
    assert loop.shapes == [("splash", (128, 12, 1024, 64)), ("flash", (64, 12, 1024, 64))]
    assert loop.lines == ["notice: the Pallas splash-attention kernel failed its probe at this session's shapes (16 "
                          "sequences x 12 heads x 1024 tokens x 64 per device): it differs; trying the "
                          "flash-attention kernel"]
    loop = _Loop({F: "flash-kernel", S: "splash-kernel"}, {"splash": None})
    assert loop.choose().kind == S and loop.shapes == [("splash", (16, 12, 1024, 64))]  # no batch_for: shape's


def test_a_session_at_micro_batch_auto_probes_each_kernel_once_at_the_batch_it_trains_at(xla_runtime, monkeypatch):
    from shared.runtime.step import select_attention_and_micro_batch
    from shared.tpu import micro_batch_for

    probed = []

    def probe(name, kernel, shape, instead):
        probed.append((name, shape[0]))
        return None if name == "flash" else "it differs from SDPA"

    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v5e"])
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: "flash")
    monkeypatch.setattr(attention_select, "splash_attention_kernel", lambda *args: "splash")
    monkeypatch.setattr(attention_select.MeshProbes, "probe", lambda self, *args: probe(*args))
    cfg = train_config(preset="gpt2", micro_batch="auto", total_batch_tokens=524288)
    lines = []
    session, choice = select_attention_and_micro_batch(cfg, xla_runtime, log=lines.append)
    want = {kind: micro_batch_for(cfg, "v5e", kind, 8) for kind in (S, F, D)}
    assert want[S] > want[D]  # the kernels train at micro-batches of their own
    assert probed == [("splash", want[S]), ("flash", want[F])]  # once each, at its own
    assert (choice.kind, session.step.micro_batch) == (F, want[F])
    assert lines == [f"micro-batch auto: {want[F]} ({want[F] // 8} a device; TPU v5e, pallas-flash attention)"]
