"""What the train kernel knows of the TPU it runs on, from what a Kaggle TPU VM really exposes (monkeypatched:
no TPU here): the generation, its peak FLOP/s, whether the Pallas flash-attention kernel may run, and the
step settings chosen from them."""

import pytest
from helpers import train_config

from shared.errors import UserError
from shared.runtime.step import plan_step
from shared.tpu import (
    TPU_GENERATIONS,
    detect_tpu_generation,
    parse_tpu_generation,
    tpu_devices_present,
    tpu_pci_devices,
)

# What torch_xla's PJRT client reports for device 0 of a TPU: core_on_chip, num_cores, coords, name; no
# device_kind (docs/kaggle-tpu.md cites the source).
TPU_ATTRIBUTES = {"core_on_chip": 0, "num_cores": 1, "coords": [0, 0, 0], "name": "TPU_0"}


@pytest.mark.parametrize("accelerator_type, generation, peak_per_device, devices, flash", [
    ("v3-8", "v3", 61.5e12, 8, False),  # 4 chips x 2 TensorCores, each a torch_xla device
    ("v5litepod-8", "v5e", 197e12, 8, True),
    ("v6e-8", "v6e", 918e12, 8, True),
    ("v2-8", "v2", 22.5e12, 8, False),
    ("v4-8", "v4", 275e12, 4, True),
    ("v5p-8", "v5p", 459e12, 4, True),
])
def test_generation_from_the_tpu_vm_environment(accelerator_type, generation, peak_per_device, devices, flash,
                                                 tmp_path):
    name, source = detect_tpu_generation(env={"TPU_ACCELERATOR_TYPE": accelerator_type},
                                         device_attributes=TPU_ATTRIBUTES, pci_root=str(tmp_path))
    assert name == generation and accelerator_type in source
    gen = TPU_GENERATIONS[name]
    assert gen.peak_bf16_per_device == pytest.approx(peak_per_device)
    assert gen.pallas_flash_attention is flash  # Mosaic rejects the kernel's bf16 matmul on v2/v3
    board_peak = {"v3": 492e12, "v5e": 1576e12, "v6e": 7344e12}.get(generation)
    if board_peak:  # the 8-device boards Kaggle lends (docs/tpu-throughput.md)
        assert gen.peak_bf16_per_device * devices == pytest.approx(board_peak)


def fake_pci(root, devices: list[tuple[str, str]]) -> str:
    """A /sys/bus/pci/devices tree with (vendor, device) entries."""
    for i, (vendor, device) in enumerate(devices):
        folder = root / f"0000:00:{i:02x}.0"
        folder.mkdir(parents=True)
        (folder / "vendor").write_text(vendor + "\n")
        (folder / "device").write_text(device + "\n")
    return str(root)


def test_generation_from_pci_then_metadata_then_device_kind_then_unknown(tmp_path):
    def no_metadata():
        raise OSError("Failed to get TPU metadata")

    # Kaggle's TPU image no longer sets TPU_ACCELERATOR_TYPE: the chips on PCI (what torch_xla itself reads).
    v5e_board = fake_pci(tmp_path / "v5e", [("0x8086", "0x1237")] + [("0x1ae0", "0x0063")] * 8)
    name, source = detect_tpu_generation(env={}, device_attributes=TPU_ATTRIBUTES, tpu_type=no_metadata,
                                         pci_root=v5e_board)
    assert (name, source) == ("v5e", "8 TPU chips on PCI (device 0x0063)")
    assert tpu_devices_present(v5e_board)
    v3_board = fake_pci(tmp_path / "v3", [("0x1ae0", "0x0027")] * 4)
    assert detect_tpu_generation(env={}, tpu_type=no_metadata, pci_root=v3_board)[0] == "v3"
    # No chips on PCI (a Google NIC is not a TPU): the VM's metadata, read through torch_xla.
    empty = fake_pci(tmp_path / "none", [("0x1ae0", "0x0042")])
    assert not tpu_pci_devices(empty)
    name, source = detect_tpu_generation(env={}, device_attributes=TPU_ATTRIBUTES, tpu_type=lambda: "v5litepod",
                                         pci_root=empty)
    assert (name, source) == ("v5e", "TPU metadata accelerator type v5litepod")
    # A runtime that reports a device kind, as jax's does.
    name, source = detect_tpu_generation(env={}, device_attributes={**TPU_ATTRIBUTES, "device_kind": "TPU v6 lite"},
                                         tpu_type=no_metadata, pci_root=empty)
    assert name == "v6e" and "device_kind" in source
    # Nothing names a generation: unknown, and the reason says what was seen.
    name, source = detect_tpu_generation(env={"TPU_ACCELERATOR_TYPE": ""}, device_attributes=TPU_ATTRIBUTES,
                                         tpu_type=no_metadata, pci_root=empty)
    assert name is None and "unknown TPU" in source


@pytest.mark.parametrize("text, expected", [
    ("v3-8", "v3"), ("v3", "v3"), ("V3-32", "v3"), ("v5litepod-16", "v5e"), ("v5lite", "v5e"), ("v6e-8", "v6e"),
    ("v5p-8", "v5p"), ("TPU v3", "v3"), ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"), ("TPU v6 lite", "v6e"),
    ("TPU v4", "v4"), ("", None), ("cpu", None), ("v9-8", None), ("TPU_0", None), ("NvidiaTeslaT4", None),
])
def test_parse_tpu_generation(text, expected):
    assert parse_tpu_generation(text) == expected


class FakeRuntime:
    def __init__(self, generation=None, name="xla"):
        self.tpu_generation = TPU_GENERATIONS.get(generation or "")
        self.name = name


def one_micro_step(preset: str) -> dict:
    """Settings for a step of one micro-step (no accumulation) of 64 sequences."""
    return {"micro_batch": 64, "total_batch_tokens": 64 * train_config(preset=preset).model.shape.block_size}


@pytest.mark.parametrize("preset, generation, attention, checkpointing, scan", [
    ("gpt2", "v3", "sdpa", False, False),  # 12 layers: the scan compiled slower than the plain stack
    ("gpt2-medium", "v3", "sdpa", True, True),  # 16 GB per v3 core
    ("gpt2-medium", "v5e", "pallas-flash", True, False),  # scan is not used with the Pallas kernel
    ("gpt2-medium", "v6e", "pallas-flash", False, False),  # 32 GB per v6e chip
    ("gpt2-large", "v6e", "sdpa", True, True),
    ("tiny", "v3", "sdpa", False, False),  # 2 layers: nothing to gain from the scan
    ("gpt2-xl", None, "sdpa", False, False),  # XLA's CPU devices (no TPU): auto leaves both off
])
def test_auto_step_plan_per_preset_and_tpu(preset, generation, attention, checkpointing, scan):
    runtime = FakeRuntime(generation)
    single = plan_step(train_config(preset=preset, **one_micro_step(preset)), runtime, attention, scan_available=True)
    assert (single.activation_checkpointing, single.scan_layers, single.accum_loop) == (checkpointing, scan, False)
    # With accumulation the step is one graph (the XLA loop), and the scan, wrong inside that loop, stays off.
    accumulating = plan_step(train_config(preset=preset), runtime, attention, scan_available=True)
    assert train_config(preset=preset).grad_accum_steps > 1
    assert (accumulating.activation_checkpointing, accumulating.scan_layers, accumulating.accum_loop) == (
        checkpointing, False, True)
    no_loop = plan_step(train_config(preset=preset, grad_accum_loop=False), runtime, attention, scan_available=True)
    assert (no_loop.scan_layers, no_loop.accum_loop) == (scan, False)
    # Without jax/torchax the scan is never chosen; explicit settings win over auto.
    without_jax = plan_step(train_config(preset=preset, **one_micro_step(preset)), runtime, attention,
                            scan_available=False)
    assert not without_jax.scan_layers
    forced = plan_step(train_config(preset=preset, activation_checkpointing="on", scan_layers="off",
                                    grad_accum_loop=False), runtime, attention, scan_available=True)
    assert (forced.activation_checkpointing, forced.scan_layers, forced.accum_loop) == (True, False, False)


def test_scan_layers_on_is_refused_where_it_cannot_run():
    with pytest.raises(UserError, match="--scan-layers on needs the xla backend"):
        plan_step(train_config(scan_layers="on"), FakeRuntime(name="torch"), scan_available=True)
    with pytest.raises(UserError, match="jax\\+torchax not importable"):
        plan_step(train_config(scan_layers="on"), FakeRuntime("v3"), scan_available=False)
    with pytest.raises(UserError, match="wrong losses inside torch_xla's gradient-accumulation loop"):
        plan_step(train_config(scan_layers="on"), FakeRuntime("v3"), scan_available=True)
    with pytest.raises(UserError, match="--activation-checkpointing must be auto, on or off"):
        train_config(activation_checkpointing="yes").validate()


def test_scan_availability_is_what_torch_xla_can_import_and_asked_only_where_it_could_run(monkeypatch):
    import torch_xla._internal.jax_workarounds as workarounds

    from shared.runtime import xla_runtime

    # torch_xla's wheel carries a torchax that imports flax: found by find_spec, unusable by torch_xla.
    monkeypatch.setattr(workarounds, "maybe_get_torchax", lambda: None)
    assert xla_runtime.scan_layers_available() is False
    monkeypatch.setattr(workarounds, "maybe_get_torchax", lambda: object())
    monkeypatch.setattr(workarounds, "maybe_get_jax", lambda *a, **k: object())
    assert xla_runtime.scan_layers_available() is True

    def must_not_ask():
        raise AssertionError("scan availability asked (jax imported) where the scan cannot be chosen")

    monkeypatch.setattr(xla_runtime, "scan_layers_available", must_not_ask)
    for preset, generation in (("gpt2", "v3"), ("gpt2-xl", None), ("tiny", "v5e")):
        assert not plan_step(train_config(preset=preset, grad_accum_loop=False), FakeRuntime(generation)).scan_layers
    monkeypatch.setattr(xla_runtime, "scan_layers_available", lambda: True)
    assert plan_step(train_config(preset="gpt2-medium", grad_accum_loop=False), FakeRuntime("v3")).scan_layers


# --- the attention kernel's probe: forward and backward against SDPA, at the session's shapes -----------------

PROBE_SHAPE = (8, 2, 64, 16)  # (B, H, T, D): one sequence per XLA CPU device
FLASH_SHAPE = (8, 2, 128, 16)  # the same at a length the flash kernel's blocks tile: a session tries it there


@pytest.fixture
def flash_host(xla_runtime, monkeypatch):
    """The suite's runtime on a TPU that compiles the flash kernel (a v5e): a session that tries it
    (shared/model/attention.py) at FLASH_SHAPE with the setting "flash" (splash skipped)."""
    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v5e"])
    return xla_runtime


def manual_attention(q, k, v):
    """Causal attention written out (fp32 scores and softmax, as a flash kernel keeps them): a correct kernel."""
    import torch

    T = q.shape[-2]
    scores = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


def wrong_dk_kernel(scale: float):
    """A kernel whose forward is exact attention and whose backward returns dk times `scale` (dq, dv exact)."""
    import torch

    from shared.runtime.attention_probe import sdpa_causal

    class WrongDk(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return sdpa_causal(q, k, v)

        @staticmethod
        def backward(ctx, grad_out):
            q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
            with torch.enable_grad():
                dq, dk, dv = torch.autograd.grad(sdpa_causal(q, k, v), (q, k, v), grad_out)
            return dq, dk * scale, dv

    return WrongDk.apply


def test_the_runtimes_device_type_is_what_its_client_reports_not_the_pjrt_device_setting(xla_runtime, monkeypatch):
    # torch_xla's runtime.device_type() echoes PJRT_DEVICE; the session's device check reads the hardware the
    # runtime's client reports for its devices instead (here 8 CPU devices, whatever the setting now says).
    import torch_xla.runtime as xr

    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert xr.device_type() == "TPU"  # the echo
    assert xla_runtime.device_type == "CPU" and xla_runtime.tpu_generation is None


def test_attention_probe_accepts_exact_kernels_sharded_as_training_shards(xla_runtime):
    from shared.runtime.attention_probe import probe_attention_kernel, sdpa_causal

    for kernel in (sdpa_causal, manual_attention):
        assert probe_attention_kernel(kernel, PROBE_SHAPE, xla_runtime.device, xla_runtime.shard_batch,
                                      xla_runtime.sync) is None
        assert probe_attention_kernel(kernel, PROBE_SHAPE) is None  # eager torch on the CPU


def test_attention_probe_rejects_a_wrong_gradient_and_names_it(xla_runtime):
    import re

    from shared.runtime.attention_probe import ATTENTION_PROBE_TOLERANCE, probe_attention_kernel

    failure = probe_attention_kernel(wrong_dk_kernel(1.1), PROBE_SHAPE, xla_runtime.device, xla_runtime.shard_batch,
                                     xla_runtime.sync)
    m = re.fullmatch(r"it differs from SDPA: (\w+) by ([\d.]+) \(max error over SDPA's largest value; "
                     r"tolerance 0\.03\)", failure or "")
    assert m, failure
    assert m.group(1) == "dk" and float(m.group(2)) == pytest.approx(0.1, abs=0.01)  # dk only: output, dq, dv agree
    assert ATTENTION_PROBE_TOLERANCE == 0.03
    # A dk off by 1% passes (within bf16's rounding); NaN gradients and a kernel without the causal mask do not.
    assert probe_attention_kernel(wrong_dk_kernel(1.01), PROBE_SHAPE) is None
    assert probe_attention_kernel(wrong_dk_kernel(float("nan")), PROBE_SHAPE).startswith(
        "it differs from SDPA: dk by nan")
    import torch.nn.functional as F

    not_causal = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    names = re.findall(r"(no-grad output|output|dq|dk|dv) by", probe_attention_kernel(not_causal, PROBE_SHAPE))
    assert names == ["output", "dq", "dk", "dv", "no-grad output"]  # and its forward without gradients


def test_attention_probe_reports_a_failing_kernel_in_one_line():
    from shared.runtime.attention_probe import probe_attention_kernel

    def broken(q, k, v):
        raise RuntimeError("Mosaic failed to compile TPU kernel: Unsupported matmul\nmore detail")

    assert probe_attention_kernel(broken, PROBE_SHAPE) == (
        "RuntimeError: Mosaic failed to compile TPU kernel: Unsupported matmul")


def test_an_import_of_jax_that_hangs_leaves_sdpa_with_one_line(xla_runtime, monkeypatch, capsys):
    # Importing jax may load libtpu's plugin, before the probe's own limit starts: bounded the same way.
    import importlib.abc
    import sys
    import threading

    import shared.runtime.attention_select as attention_select

    released = threading.Event()

    class HangingJax(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "jax":
                released.wait(60)
                raise ImportError("released")
            return None

    monkeypatch.delitem(sys.modules, "jax", raising=False)
    monkeypatch.setattr(sys, "meta_path", [HangingJax(), *sys.meta_path])
    monkeypatch.setattr(attention_select, "PROBE_TIMEOUT_S", 0.5)
    try:
        assert attention_select.flash_attention_kernel(xla_runtime.mesh) is None
    finally:
        released.set()
    assert capsys.readouterr().out == ("notice: importing jax for the Pallas flash-attention kernel gave no answer "
                                       "within 0.5 s; using SDPA\n")


def test_the_runtime_keeps_sdpa_with_a_notice_when_the_kernel_is_wrong(flash_host, monkeypatch, capsys):
    import shared.runtime.attention_select as attention_select

    xla_runtime = flash_host
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: wrong_dk_kernel(1.5))
    choice = xla_runtime.select_attention(*FLASH_SHAPE, "flash")
    assert (choice.kind, choice.kernel) == ("sdpa", None)
    start, out = capsys.readouterr().out.split("\n", 1)
    assert start == "probing attention kernels: flash, at most 15 minutes in all"
    assert out.count("\n") == 1 and out.startswith(
        "notice: the Pallas flash-attention kernel failed its probe at this session's shapes (1 sequences x 2 "
        "heads x 128 tokens x 16 per device): it differs from SDPA: dk by 0.5")
    assert out.endswith("; using SDPA\n")
    # Where the kernel agrees it is installed; a later session's probe that fails puts SDPA back.
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: manual_attention)
    choice = xla_runtime.select_attention(*FLASH_SHAPE, "flash")
    assert (choice.kind, choice.kernel) == ("pallas-flash", manual_attention)
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: wrong_dk_kernel(1.5))
    choice = xla_runtime.select_attention(*FLASH_SHAPE, "flash")
    assert (choice.kind, choice.kernel) == ("sdpa", None)


def test_the_trainer_probes_the_kernel_at_its_own_shapes_sharded_per_device(flash_host, monkeypatch, tmp_path):
    import numpy as np
    import torch_xla

    import shared.runtime.attention_select as attention_select
    import shared.train.trainer as trainer
    from shared.data import write_shard
    from shared.runtime.attention_probe import sdpa_causal
    from shared.train.trainer import train

    calls = []

    def recording_kernel(q, k, v):
        calls.append([(tuple(t.shape), torch_xla._XLAC._get_xla_sharding_spec(t)) for t in (q, k, v)])
        return sdpa_causal(q, k, v)

    class Probed(Exception):
        pass

    select = trainer.select_attention_and_micro_batch

    def select_then_stop(*args, **kwargs):
        _, attention = select(*args, **kwargs)
        raise Probed(attention.kind)  # the probe is what this test is about: no training step

    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: recording_kernel)
    monkeypatch.setattr(trainer, "select_attention_and_micro_batch", select_then_stop)
    write_shard(tmp_path / "t_train_000000.bin", np.arange(20_000) % 1000)
    cfg = train_config(preset="tiny", data_dir=str(tmp_path), out_dir=str(tmp_path / "out"), seq_len=128,
                       micro_batch=16, total_batch_tokens=16 * 128, eval_every=0, progress=False, wandb_project="",
                       xla_cache=False, attention="flash")
    with pytest.raises(Probed, match="pallas-flash"):
        train(cfg, flash_host, log=lambda *a: None)
    # The tiny preset's 4 heads of 128 / 4 = 32 over 128 tokens; 16 sequences, 2 on each of the 8 devices. Called
    # twice: with gradients, and without (an eval's forward).
    assert len(calls) == 2
    for shape, sharding in calls[0] + calls[1]:
        assert shape == (16, 4, 128, 32)
        assert sharding.startswith("{devices=[8,1,1,1]")  # the batch split over the 'data' axis: 2 per device


@pytest.mark.parametrize("generation, attention, preset, checkpointing, expected", [
    ("v5e", "pallas-flash", "gpt2", False, 128),  # libtpu: 11.0 GiB a chip; 256: 15.0 (docs/tpu-throughput.md 10)
    ("v5e", "sdpa", "gpt2", False, 64),  # libtpu: 9.9 GiB a chip
    ("v6e", "pallas-flash", "gpt2", False, 256),  # libtpu: 19.3 GiB a chip; 512: 29.6
    ("v6e", "sdpa", "gpt2", False, 128),  # libtpu: 23.1 GiB a chip
    ("v3", "sdpa", "gpt2", False, 64),  # 16 GB per core, 8 cores
    ("v5e", "pallas-flash", "gpt2-medium", True, 128),  # libtpu: 64 took 8.1 GiB a chip, 128 9.7
    (None, "sdpa", "gpt2", False, 16),  # no TPU: the project's default
])
def test_auto_micro_batch_from_the_memory_arithmetic(generation, attention, preset, checkpointing, expected):
    from shared.tpu import HBM_USABLE_FRACTION, activation_bytes_per_sequence, auto_micro_batch

    model = train_config(preset=preset).model.shape
    assert auto_micro_batch(generation, attention, model, 1024, 8, checkpointing) == expected
    # gpt2 by hand: 22 bytes per parameter static; per sequence 12 layers x 1024 tokens x 38 x 768 bytes plus
    # the head's chunk, 1024 x 50,304 x 2, plus 12 layers x 12 heads x 1024^2 x 6 without flash attention.
    flash = 12 * 1024 * 38 * 768 + 1024 * 50304 * 2
    assert activation_bytes_per_sequence(12, 12, 768, 50304, 1024, "pallas-flash") == flash == 461_635_584
    assert activation_bytes_per_sequence(12, 12, 768, 50304, 1024, "sdpa") == flash + 12 * 12 * 1024**2 * 6
    # Each covers what the TPU compiler's total grows by a sequence (a chip) for gpt2's step, on both TPUs: flash
    # 0.25 GiB (v5e) and 0.32 GiB (v6e), SDPA 1.02 and 1.27 GiB.
    assert flash >= 0.32 * 2**30 and flash + 12 * 12 * 1024**2 * 6 >= 1.27 * 2**30
    if generation and preset == "gpt2" and not checkpointing:  # the largest power of two that fits, not more
        room = HBM_USABLE_FRACTION * TPU_GENERATIONS[generation].hbm_gib_per_device * 2**30 - 22 * 124_475_904
        per_sequence = activation_bytes_per_sequence(12, 12, 768, 50304, 1024, attention)
        assert (expected // 8) * per_sequence <= room < (expected // 4) * per_sequence


@pytest.mark.parametrize("generation, fsdp, expected", [
    # The picks the TPU compiler accepted, the next larger refused (gpt2-xl's 128 on v5e compiled too, its 32 did
    # not: the compiler's totals under fsdp are not monotone in the micro-batch; docs/tpu-throughput.md section 10).
    ("v5e", True, (128, 64)), ("v6e", True, (256, 256)),
    # Replicated: gpt2-large on v6e at 256 (32 a chip) is 22.6 GiB of 32. On v5e neither fits within auto's 85% at
    # one sequence a chip (gpt2-large there: 15.0 GiB of 16), and --plan refuses them.
    ("v5e", False, (8, 8)), ("v6e", False, (256, 8)),
])
def test_micro_batch_auto_for_the_large_presets_is_what_the_tpu_compiler_accepted(generation, fsdp, expected):
    from shared.tpu import micro_batch_for, smallest_step_bytes

    got = tuple(micro_batch_for(train_config(preset=p, fsdp=fsdp), generation, "pallas-flash", 8)
                for p in ("gpt2-large", "gpt2-xl"))
    assert got == expected
    if not fsdp:  # where auto's floor of 1 a chip is left, --plan refuses the step: one sequence is over the margin
        for preset, size in zip(("gpt2-large", "gpt2-xl"), got, strict=True):
            shape = train_config(preset=preset).model.shape
            needed, usable = smallest_step_bytes(generation, "pallas-flash", shape, 1024, 8,
                                                 activation_checkpointing=True)
            assert (needed > usable) == (size == 8)


@pytest.mark.parametrize("generation, attention, expected", [
    ("v3", "sdpa", (64, 128, 8)),
    ("v5e", "pallas-flash", (128, 128, 8)),
    ("v5e", "sdpa", (64, 128, 8)),
    ("v6e", "pallas-flash", (256, 128, 256)),
    ("v6e", "sdpa", (128, 32, 128)),
])
def test_micro_batch_auto_with_default_settings_matches_the_docs_table(generation, attention, expected):
    """`--activation-checkpointing auto` (the default) is sized for as the step will run it: gpt2-medium on a 16 GB
    device checkpoints (the step turns it on), so its micro-batch is the checkpointed one, not the smaller one
    without; on a 32 GB v6e chip it does not, and gpt2-large does."""
    from shared.tpu import auto_micro_batch, micro_batch_for

    got = tuple(micro_batch_for(train_config(preset=p), generation, attention, 8)
                for p in ("gpt2", "gpt2-medium", "gpt2-large"))
    assert got == expected
    for preset, size in zip(("gpt2-medium", "gpt2-large"), expected[1:], strict=True):
        cfg = train_config(preset=preset)
        step = plan_step(cfg, FakeRuntime(generation), attention, scan_available=False)
        # 512 sequences a step: every power of two up to it divides them, so nothing is lowered
        assert auto_micro_batch(generation, attention, cfg.model.shape, 1024, 8, step.activation_checkpointing) == size


class _ProbedRuntime:
    """A runtime whose flash kernel passes its probe only up to `flash_up_to` sequences a micro-step."""

    def __init__(self, generation: str | None, flash_up_to: int, num_devices: int = 8):
        from shared.tpu import TPU_GENERATIONS

        self.tpu_generation = TPU_GENERATIONS.get(generation or "")
        self.num_devices, self.flash_up_to, self.probed = num_devices, flash_up_to, []

    def select_attention(self, batch: int, n_head: int, seq_len: int, head_dim: int, setting: str = "auto",
                         batch_for=None):
        # As XlaRuntime's: the Pallas kernel probed once, at the micro-batch it would train at (`batch_for`).
        from shared.model.attention import AttentionChoice

        flash = self.tpu_generation is not None and self.tpu_generation.pallas_flash_attention
        at = batch_for("pallas-flash") if flash and batch_for else batch
        self.probed.append(at)
        return AttentionChoice("pallas-flash" if flash and at <= self.flash_up_to else "sdpa")


@pytest.mark.parametrize("preset, generation, flash_up_to, probed, chosen, attention", [
    ("gpt2", "v5e", 10**6, [128], 128, "pallas-flash"),  # flash probed once, at its own 16 a device, and passes
    ("gpt2", "v5e", 64, [128], 64, "sdpa"),  # flash fails at 128: SDPA, and SDPA's smaller 64 (9.9 GiB, libtpu)
    ("gpt2-medium", "v6e", 8, [128], 32, "sdpa"),  # flash fails at 128: SDPA, and SDPA's smaller micro-batch
    ("gpt2", "v6e", 10**6, [256], 256, "pallas-flash"),
    ("gpt2", None, 0, [16], 16, "sdpa"),  # no TPU: no kernel to probe, SDPA at 2 a device
])
def test_micro_batch_auto_follows_the_attention_kernel_that_passed(preset, generation, flash_up_to, probed, chosen,
                                                                    attention):
    from shared.runtime.step import select_attention_and_micro_batch

    runtime = _ProbedRuntime(generation, flash_up_to)
    lines = []
    cfg, choice = select_attention_and_micro_batch(train_config(preset=preset, micro_batch="auto"), runtime,
                                                   lines.append)
    assert (runtime.probed, cfg.step.micro_batch, choice.kind) == (probed, chosen, attention)
    assert cfg.grad_accum_steps == 512 // chosen
    assert lines == [f"micro-batch auto: {chosen} ({chosen // 8} a device; TPU {generation or 'none'}, {attention} "
                     "attention)"]
    fixed, _ = select_attention_and_micro_batch(train_config(preset="gpt2", micro_batch=32), runtime, lines.append)
    assert fixed.step.micro_batch == 32 and runtime.probed[-1] == 32 and len(lines) == 1


def test_a_kernel_libtpu_refuses_for_its_mosaic_version_is_lowered_at_the_version_it_names_and_probed_again(
        flash_host, monkeypatch, capsys):
    # Kaggle's TPU image: jax 0.7.2 serializes Pallas kernels at Mosaic version 7 for libtpu 0.0.17, which reads
    # at most 4 (the TPU compiler's own refusal, docs/tpu-throughput.md). This kernel fails as libtpu does, deep
    # in a long error, until jax's hook says 4.
    import jax._src.tpu_custom_call as tpu_custom_call

    from shared.runtime.attention_probe import sdpa_causal

    monkeypatch.setattr(tpu_custom_call, "get_ir_version", lambda ctx: 7)  # restored after the test
    calls = []

    def kaggle_flash(q, k, v):
        calls.append(tpu_custom_call.get_ir_version(None))
        if calls[-1] != 4:
            raise RuntimeError(f"Error while compiling the graph\nINTERNAL: Failed to deserialize the Mosaic module: "
                               f"INTERNAL: Unsupported version: expected <= 4 but got {calls[-1]}\n(stack)")
        return sdpa_causal(q, k, v)

    import shared.runtime.attention_select as attention_select

    xla_runtime = flash_host
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: kaggle_flash)
    choice = xla_runtime.select_attention(*FLASH_SHAPE, "flash")
    assert (choice.kind, choice.kernel) == ("pallas-flash", kaggle_flash)
    assert calls[0] == 7 and set(calls[1:]) == {4}  # refused once, then probed (forward and backward) at 4
    assert capsys.readouterr().out == (
        "probing attention kernels: flash, at most 15 minutes in all\n"
        "notice: this libtpu reads Pallas kernels up to Mosaic version 4, older than jax serializes them at; the "
        "flash-attention kernel is lowered at version 4\n")


def test_a_kernel_that_fails_at_the_pinned_version_too_leaves_sdpa_with_libtpus_words(flash_host, monkeypatch,
                                                                                      capsys):
    import jax._src.tpu_custom_call as tpu_custom_call

    monkeypatch.setattr(tpu_custom_call, "get_ir_version", lambda ctx: 8)

    def refused(q, k, v):
        raise RuntimeError("INTERNAL: Unsupported version: expected <= 3 but got 8")

    import shared.runtime.attention_select as attention_select

    xla_runtime = flash_host
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: refused)
    choice = xla_runtime.select_attention(*FLASH_SHAPE, "flash")
    assert choice.kind == "sdpa" and tpu_custom_call.get_ir_version(None) == 3
    lines = capsys.readouterr().out.splitlines()[1:]  # after the line that starts the probing
    assert len(lines) == 2 and lines[1].startswith("notice: the Pallas flash-attention kernel failed its probe")
    assert "RuntimeError: Unsupported version: expected <= 3 but got 8; using SDPA" in lines[1]


def test_the_mosaic_version_a_libtpu_reads_follows_its_build_date():
    import datetime

    from shared.runtime.mosaic_version import libtpu_build_date, readable_version, version_for_libtpu

    # libtpu 0.0.17's compile-only client, as Kaggle's image pins it.
    built = libtpu_build_date("TFRT TPU v5 lite\nBuilt on Jun 12 2025 16:39:57 (1749771597) cl/769337304")
    assert built == datetime.date(2025, 6, 12) and version_for_libtpu(built) == 4
    assert [version_for_libtpu(datetime.date(2025, m, d)) for m, d in ((6, 19), (7, 26), (8, 13), (8, 14))] == [
        5, 6, 7, None]
    assert libtpu_build_date("PJRT C API\nno date here") is None
    assert readable_version("x: Unsupported version: expected <= 4 but got 8") == 4
    assert readable_version("Mosaic failed to compile TPU kernel") is None
