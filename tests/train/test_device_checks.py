"""Never train on the wrong device: where TPU chips are present torch_xla is asked for the TPU by name, and a
session built for a TPU whose runtime started on anything else exits 2 in one line (TPU chips monkeypatched:
there are none here; the runtime is the suite's XLA CPU one)."""

import os

import pytest

from shared import tpu
from shared.errors import UserError, run_cli
from shared.kaggle import env
from shared.runtime.device import make_runtime


@pytest.fixture
def chips(monkeypatch):
    """Set `.present` to pretend this host has TPU chips (the one seam both checks read)."""
    class Chips:
        present = False

    monkeypatch.setattr(tpu, "tpu_devices_present", lambda *a, **k: Chips.present)
    return Chips


@pytest.fixture
def session(monkeypatch):
    """A kernel session outside the local Kaggle, with no build recorded yet (restored after the test)."""
    monkeypatch.delenv(env.LOCAL_ROOT_ENV, raising=False)
    monkeypatch.delenv(env.LOCAL_ACCELERATOR_ENV, raising=False)
    monkeypatch.setattr(env, "_built_for", {})


def test_pjrt_device_is_tpu_where_chips_are_present_and_left_alone_when_set(monkeypatch, chips):
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    chips.present = True
    tpu.default_xla_env()
    assert os.environ["PJRT_DEVICE"] == "TPU"
    assert "CPU_NUM_DEVICES" not in os.environ
    # No chips: torch_xla's CPU backend with 8 devices, as before.
    monkeypatch.delenv("PJRT_DEVICE")
    chips.present = False
    tpu.default_xla_env()
    assert (os.environ["PJRT_DEVICE"], os.environ["CPU_NUM_DEVICES"]) == ("CPU", "8")
    # A value already set is the user's: kept, chips or not.
    for value, present in (("CPU", True), ("TPU", False)):
        monkeypatch.setenv("PJRT_DEVICE", value)
        monkeypatch.delenv("CPU_NUM_DEVICES")
        chips.present = present
        tpu.default_xla_env()
        assert os.environ["PJRT_DEVICE"] == value
        assert os.environ.get("CPU_NUM_DEVICES") == ("8" if value == "CPU" else None)


def test_a_tpu_build_whose_runtime_started_on_the_cpu_exits_2_in_one_line(chips, session, capsys):
    chips.present = True
    env.check_tpu_present("TpuV5E8", "train")  # the chips are there: the check before any work passes
    with pytest.raises(SystemExit) as exit_:
        run_cli(lambda: make_runtime("xla"))  # the suite's runtime: torch_xla on its CPU devices
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == ("error: this train kernel was built for a TPU (TpuV5E8) but its runtime started on CPU although "
                   "this host has TPU chips (PJRT_DEVICE=CPU); stopping before any step. Check the notebook's "
                   "accelerator setting, and leave PJRT_DEVICE unset or TPU\n")
    # The eval kernel goes through the same check, whatever backend it asks for.
    env.check_tpu_present("TpuV6E8", "eval")
    with pytest.raises(UserError, match=r"^this eval kernel was built for a TPU \(TpuV6E8\) but its runtime "
                                        r"started on CPU although this host has TPU chips"):
        make_runtime("cpu")


def test_the_session_device_is_checked_only_for_tpu_builds(chips, session):
    chips.present = True
    assert make_runtime("xla").device_type == "CPU"  # no build recorded: a local run, nothing to hold it to
    env.check_tpu_present("", "train")  # built for a CPU session
    assert make_runtime("xla").device_type == "CPU"
    env.check_tpu_present("TpuV5E8", "train")
    assert env.check_session_device("TPU") is None
    with pytest.raises(UserError, match="started on CUDA although this host has TPU chips"):
        env.check_session_device("CUDA")
    chips.present = False
    with pytest.raises(UserError, match="started on CPU and this host has no TPU chips"):
        env.check_session_device("CPU")


def test_the_local_kaggle_cpu_devices_stand_in_for_a_tpu_only_without_chips(chips, session, monkeypatch,
                                                                              tmp_path):
    monkeypatch.setenv(env.LOCAL_ROOT_ENV, str(tmp_path))
    monkeypatch.setenv(env.LOCAL_ACCELERATOR_ENV, "TpuV5E8")
    env.check_tpu_present("TpuV5E8", "train")
    runtime = make_runtime("xla")
    assert (runtime.name, runtime.device_type, runtime.num_devices) == ("xla", "CPU", 8)
    # With TPU chips on the host, its CPU devices are the wrong device there too.
    chips.present = True
    with pytest.raises(UserError, match=r"^this train kernel was built for a TPU \(TpuV5E8\) but its runtime "
                                        r"started on CPU although this host has TPU chips"):
        make_runtime("xla")
    # The local rule before any work is unchanged: a TPU build needs a TPU-shaped session.
    monkeypatch.setenv(env.LOCAL_ACCELERATOR_ENV, "")
    with pytest.raises(UserError, match=r"built for a TPU \(TpuV5E8\) but this session has none \(the local "
                                        r"Kaggle session's machine is CPU\)"):
        env.check_tpu_present("TpuV5E8", "train")
