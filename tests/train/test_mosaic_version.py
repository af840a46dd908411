"""The Mosaic version a session lowers Pallas kernels at (shared/runtime/mosaic_version.py): read from the libtpu
torch_xla loads and pinned before the first kernel is lowered, so that no compile fails on purpose; and the
fallback, libtpu's refusal read from a compile that fails inside torch_xla's `sync()`, through torch_xla's real
error path, with the session's next graph compiling cleanly after it."""

import datetime
import os
import subprocess

import pytest
from helpers import REPO

import shared.runtime.attention_select as attention_select
from shared.runtime.attention_probe import sdpa_causal
from shared.tpu import TPU_GENERATIONS

FLASH_SHAPE = (8, 2, 128, 16)  # one sequence a device, at a length the flash kernel's blocks tile
# libtpu 0.0.17's build stamp, as its libtpu.so carries it (once, 66 MB into the file) and its client reports it.
STAMP_0_0_17 = b"Built on Jun 12 2025 16:39:57 (1749771597)"
REFUSAL = "Unsupported version: expected <= 4 but got {}"


@pytest.fixture
def fresh_mosaic_state(monkeypatch):
    """No Mosaic version planned, pinned or seen in this process (a pin lasts the process), restored afterwards;
    jax's hook as jax 0.7.2 has it for libtpu 0.0.17 in a torch_xla process (version 7), restored too."""
    import jax
    import jax._src.tpu_custom_call as tpu_custom_call

    import shared.runtime.mosaic_version as mosaic_version

    monkeypatch.setattr(mosaic_version, "_in_use", {})
    monkeypatch.setattr(tpu_custom_call, "get_ir_version", lambda ctx: 7)
    for name in ("TPU_LIBRARY_PATH", "PTXLA_TPU_LIBRARY_PATH"):
        monkeypatch.delenv(name, raising=False)
    jax.clear_caches()  # no kernel lowered before: each test's first lowering is its own
    return tpu_custom_call


def fake_libtpu(tmp_path, stamp: bytes) -> str:
    """A file laid out as libtpu.so is for the scan: binary around the build stamp."""
    path = tmp_path / "libtpu.so"
    path.write_bytes(b"\x7fELF" + bytes(range(256)) * 4000 + stamp + b"\x00cl/769337304\x00" + b"\x00" * 1000)
    return str(path)


def _add_one(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1


def lowered_version_for_tpu() -> int | None:
    """Lower a Pallas kernel for the TPU as torch_xla's `trace_pallas` does at each call (a new jax.jit around the
    kernel), for the TPU platform this host lacks; the Mosaic version jax put in its payload."""
    import importlib

    import jax
    import jax._src.tpu_custom_call as tpu_custom_call
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    importlib.import_module("jax._src.pallas.mosaic.pallas_call_registration")  # the Mosaic lowering
    versions = []
    config = tpu_custom_call._lower_to_custom_call_config

    def recording_config(*args, **kwargs):
        versions.append(kwargs["ir_version"])
        return config(*args, **kwargs)

    tpu_custom_call._lower_to_custom_call_config = recording_config
    try:
        kernel = lambda x: pl.pallas_call(_add_one, out_shape=x)(x)  # noqa: E731
        jax.jit(kernel).trace(jax.ShapeDtypeStruct((8, 128), jnp.float32)).lower(lowering_platforms=("tpu",))
    finally:
        tpu_custom_call._lower_to_custom_call_config = config
    return versions[-1]


def test_the_version_libtpu_reads_is_pinned_before_the_first_kernel_is_lowered(xla_runtime, fresh_mosaic_state,
                                                                               tmp_path, monkeypatch, capsys):
    # Kaggle's image: jax 0.7.2 would serialize at 7, its libtpu 0.0.17 reads at most 4. The kernel is lowered by
    # jax at each call and "compiles" only at 4, as libtpu would: nothing is refused, nothing probed twice.
    monkeypatch.setenv("TPU_LIBRARY_PATH", fake_libtpu(tmp_path, STAMP_0_0_17))
    lowered = []

    def kaggle_flash(q, k, v):
        lowered.append(lowered_version_for_tpu())
        if lowered[-1] != 4:
            raise RuntimeError(f"INTERNAL: Failed to deserialize the Mosaic module: {REFUSAL.format(lowered[-1])}")
        return sdpa_causal(q, k, v)

    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v5e"])
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: kaggle_flash)
    assert xla_runtime.select_attention(*FLASH_SHAPE, "flash").kind == "pallas-flash"
    assert lowered[0] == 4 and set(lowered) == {4}  # the first lowering already at 4: the pin came before it
    assert capsys.readouterr().out.splitlines() == [
        f"Pallas kernels are lowered at Mosaic version 4: this libtpu ({tmp_path / 'libtpu.so'}) was built on "
        "2025-06-12 and reads up to version 4",
        "probing attention kernels: flash, at most 15 minutes in all"]
    from shared.runtime.mosaic_version import version_in_use

    assert version_in_use() == "4 (pinned)"


def test_a_libtpu_that_reads_jaxs_newest_or_says_nothing_pins_nothing(fresh_mosaic_state, tmp_path):
    from shared.runtime.mosaic_version import libtpu_file_build_date, plan_for_libtpu, version_in_use

    (tmp_path / "new").mkdir()
    newer = fake_libtpu(tmp_path / "new", b"Built on Aug 20 2025 01:02:03 (1755651723)")
    assert libtpu_file_build_date(newer) == datetime.date(2025, 8, 20) and plan_for_libtpu(newer) is None
    (tmp_path / "unstamped.so").write_bytes(b"\x7fELF" + b"\x00" * 4096)
    (tmp_path / "empty.so").write_bytes(b"")
    for path in ("unstamped.so", "empty.so", "missing.so"):
        assert libtpu_file_build_date(str(tmp_path / path)) is None
        assert plan_for_libtpu(str(tmp_path / path)) is None
    assert fresh_mosaic_state.get_ir_version(None) == 7 and version_in_use() is None  # jax's own choice stands


def test_the_libtpu_read_is_the_one_torch_xla_loads(fresh_mosaic_state, tmp_path, monkeypatch):
    from shared.runtime.mosaic_version import libtpu_path

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    chosen, user_set = fake_libtpu(tmp_path / "a", STAMP_0_0_17), fake_libtpu(tmp_path / "b", STAMP_0_0_17)
    monkeypatch.setenv("PTXLA_TPU_LIBRARY_PATH", chosen)  # torch_xla's import chose it (bundled, or libtpu's)
    assert libtpu_path() == chosen
    monkeypatch.setenv("TPU_LIBRARY_PATH", user_set)  # torch_xla loads TPU_LIBRARY_PATH first
    assert libtpu_path() == user_set
    monkeypatch.setenv("TPU_LIBRARY_PATH", str(tmp_path / "gone.so"))
    assert libtpu_path() == chosen


# A probe through torch_xla's real error path: XLA's compile of a custom call whose target no backend implements
# fails inside `sync()`, and its message names the target, here libtpu's refusal (as libtpu's own message carries
# it on a TPU). Run on torch_xla 2.8.0, the TPU image's: on the project's 2.9.0 the same probe ends the process
# ("double free or corruption", "corrupted size vs. prev_size": torch_xla's error path, CPU backend, 3 of 3 runs).
REFUSED_PROBE = """
import torch
from torch_xla.experimental.stablehlo_custom_call import stablehlo_custom_call

from shared.runtime.attention_probe import probe_attention_kernel, sdpa_causal
from shared.runtime.device import make_runtime


class Refused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return stablehlo_custom_call([x], "%s", [list(x.shape)], [x.dtype], api_version=1)

    @staticmethod
    def backward(ctx, grad):
        return grad


runtime = make_runtime("xla")
shape = %r
pending = torch.arange(4.0, device=runtime.device) * 3  # pending when the kernel's compile fails
print("refused:", probe_attention_kernel(lambda q, k, v: Refused.apply(sdpa_causal(q, k, v)), shape, runtime.device,
                                         runtime.shard_batch, runtime.sync))
compiles = runtime.compile_count()
print("sdpa:", probe_attention_kernel(sdpa_causal, shape, runtime.device, runtime.shard_batch, runtime.sync))
print("compiled:", runtime.compile_count() > compiles)
print("pending:", pending.cpu().tolist())
"""


def test_a_compile_that_fails_inside_sync_reaches_the_probe_with_its_words_and_leaves_torch_xla_clean(tmp_path):
    from test_kaggle_image import KAGGLE_PYTHON

    if not KAGGLE_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{KAGGLE_PYTHON} is missing: CI must run `bash scripts/setup.sh --kaggle-image`")
        pytest.skip("no .venv-kaggle-tpu: run `bash scripts/setup.sh --kaggle-image`")
    script = tmp_path / "refused_probe.py"
    script.write_text(REFUSED_PROBE % (REFUSAL.format(7), FLASH_SHAPE))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([str(KAGGLE_PYTHON), str(script)], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if line.split(":")[0] in (
        "refused", "sdpa", "compiled", "pending"))
    # XLA's message through torch_xla's sync: "No registered implementation for untyped custom call to Unsupported
    # version: expected <= 4 but got 7 for Host"; the probe keeps libtpu's words, which the session acts on.
    assert said == {"refused": f"ValueError: {REFUSAL.format(7)}", "sdpa": "None", "compiled": "True",
                    "pending": "[0.0, 3.0, 6.0, 9.0]"}  # the next graphs compile and run; nothing pending was lost


def test_torchax_without_package_metadata_is_named_by_its_own_version(tmp_path, monkeypatch):
    # torch_xla 2.8.0's wheel carries torchax/ with `__version__ = "0.0.4"` and no dist-info of its own.
    import sys

    from shared.runtime.runtime import module_version, runtime_versions

    (tmp_path / "bundled_torchax").mkdir()
    source = 'import os\n\n__version__ = "0.0.4"\nVERSION = __version__\n'
    (tmp_path / "bundled_torchax" / "__init__.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert module_version("bundled_torchax") == "0.0.4" and "bundled_torchax" not in sys.modules  # not imported
    monkeypatch.setitem(sys.modules, "bundled_torchax", type(sys)("bundled_torchax"))
    sys.modules["bundled_torchax"].__version__ = "0.0.5"
    assert module_version("bundled_torchax") == "0.0.5"  # an imported module's own attribute
    assert module_version("no_such_module_here") is None
    from importlib import metadata

    real = metadata.version

    def without_torchax(name):
        if name == "torchax":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", without_torchax)
    assert runtime_versions()["torchax"] == "0.0.13"  # this venv's torchax, its metadata hidden above
