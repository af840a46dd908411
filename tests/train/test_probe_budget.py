"""The attention kernels' probes as a session runs them (shared/runtime/attention_probe.py, and
shared/runtime/attention_select.py `MeshProbes`): one budget for all of them, a probe that hangs stopping the session
(and its exit not waiting for the device), the forward without gradients probed too, the Mosaic re-pin lowering
the kernel afresh, and the versions a session logs against those --plan compiled with."""

import subprocess
import sys
import threading

import pytest
import torch

import shared.runtime.attention_select as attention_select
from shared.runtime.attention_probe import sdpa_causal
from shared.tpu import TPU_GENERATIONS

SHAPE = (8, 2, 256, 64)  # one sequence a device; 256 tokens: both Pallas kernels' blocks tile it


@pytest.fixture
def fresh_mosaic_state(monkeypatch):
    """No Mosaic version pinned or seen in this process (a pin lasts the process), restored afterwards."""
    import jax

    import shared.runtime.mosaic_version as mosaic_version

    monkeypatch.setattr(mosaic_version, "_in_use", {})
    jax.clear_caches()  # no kernel lowered before: each test's first lowering is its own


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


def _pallas_kernel(x):
    from jax.experimental import pallas as pl

    return pl.pallas_call(_add_one, out_shape=x)(x)


def lower_for_tpu() -> None:
    """Lower a Pallas kernel for the TPU as a session does at each probe: the same kernel function, a new jax.jit
    around it each time (torch_xla's `trace_pallas`); for the TPU platform, which this host lacks."""
    import importlib

    import jax
    import jax.experimental.pallas  # noqa: F401
    import jax.numpy as jnp

    # The Mosaic lowering, as torch_xla imports it; after pallas, which it would otherwise import circularly.
    importlib.import_module("jax._src.pallas.mosaic.pallas_call_registration")

    jax.jit(_pallas_kernel).trace(jax.ShapeDtypeStruct((8, 128), jnp.float32)).lower(lowering_platforms=("tpu",))


def test_a_repin_after_libtpu_refuses_the_version_lowers_the_kernel_afresh(xla_runtime, monkeypatch, capsys,
                                                                          fresh_mosaic_state):
    # Kaggle's image: jax 0.7.2 serializes at Mosaic version 7, libtpu 0.0.17 reads at most 4. This kernel is
    # lowered by jax at each call and "compiles" only if the version in the payload it got is 4: served jax's cached
    # lowering after the pin, it would still carry 7 (without the fix: refused twice, and SDPA).
    import jax._src.tpu_custom_call as tpu_custom_call

    monkeypatch.setattr(tpu_custom_call, "get_ir_version", lambda ctx: 7)
    payloads = []
    config = tpu_custom_call._lower_to_custom_call_config

    def recording_config(*args, **kwargs):
        payloads.append(kwargs["ir_version"])
        return config(*args, **kwargs)

    monkeypatch.setattr(tpu_custom_call, "_lower_to_custom_call_config", recording_config)

    def kaggle_flash(q, k, v):
        lower_for_tpu()
        if payloads[-1] != 4:
            raise RuntimeError(f"INTERNAL: Failed to deserialize the Mosaic module: INTERNAL: Unsupported version: "
                               f"expected <= 4 but got {payloads[-1]}")
        return sdpa_causal(q, k, v)

    probes = attention_select.MeshProbes(xla_runtime)
    probes.start(["flash"])
    assert probes.probe("flash", kaggle_flash, SHAPE, "using SDPA") is None
    assert payloads[0] == 7 and payloads[1:] and set(payloads[1:]) == {4}  # each call after the pin lowered anew
    from shared.runtime.runtime import runtime_versions

    assert runtime_versions()["mosaic"] == "4 (pinned)"
    assert capsys.readouterr().out.splitlines()[1:] == [
        "notice: this libtpu reads Pallas kernels up to Mosaic version 4, older than jax serializes them at; the "
        "flash-attention kernel is lowered at version 4"]


def test_the_mosaic_version_logged_is_jaxs_own_choice_until_one_is_pinned(monkeypatch, fresh_mosaic_state):
    import jax._src.tpu_custom_call as tpu_custom_call

    from shared.runtime.mosaic_version import pin_version, version_in_use, watch_version

    monkeypatch.setattr(tpu_custom_call, "get_ir_version", lambda ctx: 7)  # jax 0.7.2 for libtpu 0.0.17
    assert version_in_use() is None  # nothing lowered yet
    watch_version()
    watch_version()  # once: not wrapped twice
    lower_for_tpu()
    assert version_in_use() == "7"
    pin_version(4)
    assert version_in_use() == "4 (pinned)" and tpu_custom_call.get_ir_version(None) == 4


def hanging_kernel(released: threading.Event, calls: list):
    def hanging(q, k, v):  # a compile or run that never comes back
        calls.append("splash")
        released.wait(60)
        raise RuntimeError("released")

    return hanging


def test_a_probe_that_hangs_costs_at_most_the_budget_and_stops_the_session_before_training(
        xla_runtime, monkeypatch, capsys):
    import shared.runtime.attention_probe as attention_probe
    from shared.runtime.attention_probe import ProbeHung

    monkeypatch.setattr(attention_probe, "PROBE_BUDGET_S", 0.5)
    monkeypatch.setattr(attention_probe, "PROBE_FLOOR_S", 0.0)
    limits, calls, guards = [], [], []
    within = attention_probe.within
    monkeypatch.setattr(attention_probe, "within", lambda seconds, fn: limits.append(seconds) or within(seconds, fn))
    monkeypatch.setattr(attention_select, "end_at_exit_without_device_wait", lambda: guards.append(1))
    released = threading.Event()
    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v5e"])
    monkeypatch.setattr(attention_select, "splash_attention_kernel", lambda *args: hanging_kernel(released, calls))
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: calls.append("flash") or sdpa_causal)
    try:
        with pytest.raises(ProbeHung) as stopped:
            xla_runtime.select_attention(*SHAPE)
        # On a TPU the process's exit is kept from waiting for the device the hung graph may hold.
        monkeypatch.setattr(xla_runtime, "_hardware", "TPU")
        with pytest.raises(ProbeHung):
            xla_runtime.select_attention(*SHAPE)
    finally:
        released.set()
    assert str(stopped.value).startswith(
        "stopping before training: the splash-attention kernel's probe gave no answer within 0.5 s (what was left "
        "of the session's budget for its kernel probes); its compile or run may still hold the TPU")
    assert "\n" not in str(stopped.value) and str(stopped.value).endswith("(--attention flash skips it)")
    # One probe, given the whole budget; flash's kernel was made (its jax import comes first) but never probed.
    assert len(limits) == 2 and all(0 < limit <= 0.5 for limit in limits)
    assert calls == ["flash", "splash"] * 2 and guards == [1]
    assert capsys.readouterr().out == "probing attention kernels: splash, then flash, at most 0.5 s in all\n" * 2


def test_a_spent_budget_skips_the_later_probes_with_a_notice_and_keeps_sdpa(xla_runtime, monkeypatch, capsys):
    # A splash probe that took 14 of the 15 minutes (a slow compile, then a wrong gradient): flash is not started
    # with less than a minute left, and SDPA trains.
    import functools

    from shared.runtime.attention_probe import ProbeBudget

    now = [0.0]
    monkeypatch.setattr(attention_select, "ProbeBudget", functools.partial(ProbeBudget, clock=lambda: now[0]))
    probed = []

    def slow_and_wrong(q, k, v):
        if not probed:
            now[0] += 14 * 60 + 10
        probed.append("splash")
        return sdpa_causal(q, k, v) + 0.5 * (v - v.detach())  # dv off by half

    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v5e"])
    monkeypatch.setattr(attention_select, "splash_attention_kernel", lambda *args: slow_and_wrong)
    flash = lambda q, k, v: probed.append("flash") or sdpa_causal(q, k, v)  # noqa: E731
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: flash)
    choice = xla_runtime.select_attention(*SHAPE)
    assert choice.kind == "sdpa" and set(probed) == {"splash"}
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "probing attention kernels: splash, then flash, at most 15 minutes in all"
    assert lines[1].startswith("notice: the Pallas splash-attention kernel failed its probe") and lines[1].endswith(
        "; trying the flash-attention kernel")
    assert lines[2:] == [
        "notice: the attention probes' 15 minutes are spent: the flash-attention kernel is not probed; using SDPA"]


@pytest.mark.slow  # a Python process of its own, importing torch
def test_a_hung_probes_session_exits_without_waiting_for_the_device():
    # torch_xla's exit hook waits for every device op (a hung probe's graph holds the device): stood in for by a
    # hook registered first, as torch_xla's is at its import; the guard's, registered after, ends the process first.
    script = """
import atexit
atexit.register(lambda: print("waited for the device", flush=True))
from shared.errors import UserError, run_cli
from shared.runtime.attention_probe import end_at_exit_without_device_wait

def main():
    end_at_exit_without_device_wait()
    print("probing", end="")  # unflushed: the guard flushes before it ends the process
    raise UserError("stopping before training: the probe hung")

run_cli(main)
"""
    from helpers import REPO

    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "probing", "error: stopping before training: the probe "
                                                                         "hung\n")


def test_a_kernel_whose_forward_without_gradients_is_wrong_fails_its_probe(xla_runtime):
    import re

    import torch.nn.functional as F

    from shared.runtime.attention_probe import probe_attention_kernel

    def eval_not_causal(q, k, v):  # right with gradients; an eval's forward forgets the mask
        return sdpa_causal(q, k, v) if torch.is_grad_enabled() else F.scaled_dot_product_attention(q, k, v)

    for where in ((), (xla_runtime.device, xla_runtime.shard_batch, xla_runtime.sync)):
        failure = probe_attention_kernel(eval_not_causal, (8, 2, 64, 16), *where)
        assert re.findall(r"(no-grad output|output|dq|dk|dv) by", failure or "") == ["no-grad output"], failure


@pytest.mark.slow
def test_splash_with_a_wrong_plain_forward_fails_its_probe(xla_runtime, monkeypatch):
    # splash's forward without gradients is a kernel call of its own (no logsumexp): its fault alone fails the probe.
    import functools

    from shared.model import splash
    from shared.runtime.attention_probe import probe_attention_kernel

    def wrong_plain_forward(q, k, v, interpret=True):
        return splash._forward(q, k, v, interpret=interpret) * 1.1

    monkeypatch.setitem(splash._FUNCTIONS, True, (functools.partial(wrong_plain_forward, interpret=True),
                                                  splash._FUNCTIONS[True][1]))
    kernel = splash.splash_attention(xla_runtime.mesh, interpret=True, reuse_forward=True)
    failure = probe_attention_kernel(kernel, SHAPE, xla_runtime.device, xla_runtime.shard_batch, xla_runtime.sync)
    assert failure is not None and failure.startswith("it differs from SDPA: no-grad output by 0.1")


def test_the_versions_a_session_logs_and_where_they_differ_from_the_plans(fresh_mosaic_state):
    from shared.runtime.runtime import plan_versions_notice, runtime_versions
    from shared.tpu import PLAN_TPU_VERSIONS

    versions = runtime_versions()
    assert list(versions) == ["python", "torch", "torch_xla", "jax", "jaxlib", "libtpu", "torchax", "mosaic"]
    assert versions["mosaic"] is None  # no kernel lowered in this process's state
    assert plan_versions_notice({**versions, **PLAN_TPU_VERSIONS}) is None
    assert plan_versions_notice({**PLAN_TPU_VERSIONS, "jax": "0.7.1", "libtpu": None}) == (
        "notice: this session runs jax 0.7.1, libtpu -, where --plan compiled the step with jax 0.7.2, libtpu "
        "0.0.17: its compiles, memory and Mosaic version may differ from the plan's")


def test_setup_pins_the_tpu_compilers_venv_to_the_plan_versions():
    import re

    from helpers import REPO

    from shared.tpu import PLAN_TPU_VERSIONS

    (line,) = [line for line in (REPO / "scripts" / "setup.sh").read_text().splitlines()
               if line.startswith("install .venv-tpu ")]
    pins = dict(re.findall(r"([\w-]+)==([\w.]+)", line))
    assert pins == PLAN_TPU_VERSIONS


def test_each_probes_result_and_micro_batch_go_into_the_sessions_facts_for_the_chain(xla_runtime, monkeypatch,
                                                                                      tmp_path):
    # What the chain reads back to start its next session past a kernel that failed or hung
    # (scripts/chain/attention_carry.py): splash failed here, flash passed, each at the micro-batch it was probed at.
    import json

    from shared.kaggle.env import LOCAL_ROOT_ENV
    from shared.kaggle.facts import FACTS_FILE

    monkeypatch.setenv(LOCAL_ROOT_ENV, str(tmp_path))  # inside a (local) session: facts are kept

    def wrong_dv(q, k, v):
        return sdpa_causal(q, k, v) + 0.5 * (v - v.detach())

    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v5e"])
    monkeypatch.setattr(attention_select, "splash_attention_kernel", lambda *args: wrong_dv)
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: sdpa_causal)
    choice = xla_runtime.select_attention(*SHAPE,
                                          batch_for={"pallas-splash": 16, "pallas-flash": 8, "sdpa": 8}.__getitem__)
    assert choice.kind == "pallas-flash"
    probes = json.loads((tmp_path / "working" / FACTS_FILE).read_text())["attention_probes"]
    assert probes["flash"] == {"micro_batch": 8, "result": "passed"}
    assert (probes["splash"]["micro_batch"], probes["splash"]["result"]) == (16, "failed")
    assert probes["splash"]["why"].startswith("it differs from SDPA: dv by 0.4")
