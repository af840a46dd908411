"""Where a kernel is running (Kaggle, the local Kaggle, or neither) and its filesystem.

On Kaggle a kernel sees `/kaggle/input/<slug>/` (read-only inputs), `/kaggle/working` (its saved output,
20 GB) and `/kaggle/temp` (scratch), and reads user secrets through `kaggle_secrets.UserSecretsClient`.
The local Kaggle (`scripts/local_kaggle/`) runs each kernel with the same layout under a session folder
and tells it where through environment variables; this module is the one place that knows both, so a
kernel calls `kaggle_paths()` (and `shared.kaggle.secrets.get_secret(name)`, which reads the store named here)
and runs unchanged in either place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shared.errors import UserError

# Set by the local Kaggle's session runner (never on Kaggle).
LOCAL_ROOT_ENV = "LOCAL_KAGGLE_ROOT"  # a folder holding input/, working/, temp/
LOCAL_SECRETS_ENV = "LOCAL_KAGGLE_SECRETS_FILE"  # JSON {name: value} of the kernel owner's secrets
LOCAL_ACCELERATOR_ENV = "LOCAL_KAGGLE_ACCELERATOR"  # the session's machine_shape, "" for CPU
KAGGLE_ROOT = Path("/kaggle")


@dataclass(frozen=True)
class KagglePaths:
    root: Path
    input: Path
    working: Path
    temp: Path

    def input_dir(self, slug: str) -> Path:
        """The folder of an attached dataset or kernel output, given `slug` or `owner/slug`.

        Kaggle mounts a source at `/kaggle/input/<mount slug>`, the slug chosen by the server (Kaggle/kagglehub
        kaggle_cache_resolver.py; docs/kaggle-api.md); sessions have been reported (not verified from a Kaggle
        source) to mount datasets at `/kaggle/input/datasets/<owner>/<slug>` and kernel outputs at
        `/kaggle/input/notebooks/<owner>/<slug>`. The first that exists wins.
        """
        owner, _, name = slug.rpartition("/")
        candidates = [self.input / name]
        if owner:
            candidates += [self.input / "datasets" / owner / name, self.input / "notebooks" / owner / name]
        for path in candidates:
            if path.is_dir():
                return path
        raise UserError(f"input {slug!r} is not attached to this kernel (looked in "
                        f"{', '.join(str(c) for c in candidates)})")


def is_local_kaggle() -> bool:
    """True inside a session run by the local Kaggle."""
    return bool(os.environ.get(LOCAL_ROOT_ENV))


def is_kaggle() -> bool:
    """True inside a real Kaggle kernel session."""
    if is_local_kaggle():
        return False
    return bool(os.environ.get("KAGGLE_KERNEL_RUN_TYPE")) or (
        KAGGLE_ROOT.joinpath("input").is_dir() and KAGGLE_ROOT.joinpath("working").is_dir()
    )


def in_session() -> bool:
    """True inside a kernel session, on Kaggle or in the local Kaggle."""
    return is_kaggle() or is_local_kaggle()


def kaggle_paths() -> KagglePaths:
    """The session's input/working/temp folders: the real `/kaggle/...` on Kaggle, the runner's locally."""
    local = os.environ.get(LOCAL_ROOT_ENV)
    if local:
        root = Path(local)
    elif is_kaggle():
        root = KAGGLE_ROOT
    else:
        raise UserError(
            f"not inside a Kaggle session: run on Kaggle, through scripts.local_kaggle, or set {LOCAL_ROOT_ENV}"
        )
    paths = KagglePaths(root=root, input=root / "input", working=root / "working", temp=root / "temp")
    paths.temp.mkdir(parents=True, exist_ok=True)
    return paths


# The machine shape and kernel of this session's build, as check_tpu_present saw them before any work, for
# check_session_device to hold the started runtime to (empty outside a built kernel: nothing to hold it to).
_built_for: dict[str, str] = {}


def _local_session_is_tpu() -> tuple[bool, str]:
    """In the local Kaggle: (the session's machine shape is a TPU one, what that shape is)."""
    session = os.environ.get(LOCAL_ACCELERATOR_ENV) or ""
    return session.lower().startswith("tpu"), f"the local Kaggle session's machine is {session or 'CPU'}"


def check_tpu_present(machine_shape: str, kernel: str) -> None:
    """A kernel built for a TPU machine shape that finds no TPU stops here, in one line, before it touches its
    inputs or the checkpoint dataset: otherwise torch_xla would quietly train on 8 CPU devices for 9 hours.

    On Kaggle the chips must be on this host (shared.tpu.tpu_devices_present, torch_xla's own test); in the
    local Kaggle, whose XLA CPU devices stand in for a TPU, the session's machine shape must be a TPU one.
    The build is remembered for check_session_device, which checks the runtime once it has started."""
    _built_for.update(machine_shape=machine_shape, kernel=kernel)
    if not machine_shape.lower().startswith("tpu"):
        return
    if is_local_kaggle():
        present, seen = _local_session_is_tpu()
    else:
        from shared.tpu import tpu_devices_present

        present, seen = tpu_devices_present(), "no TPU chips on PCI, /dev/accel* or /dev/vfio"
    if not present:
        raise UserError(f"this {kernel} kernel was built for a TPU ({machine_shape}) but this session has none "
                        f"({seen}); stopping before any work. Check the notebook's accelerator setting and TPU quota")


def check_session_device(device_type: str) -> None:
    """Once the runtime has started (shared.runtime.device.make_runtime, for train and eval alike): a session built
    for a TPU whose runtime runs on `device_type` other than "TPU" stops in one line. Chips on the host are no
    proof that torch_xla uses them (PJRT_DEVICE set to CPU, or torch_xla falling back to CPU on its own).

    The local Kaggle's 8 XLA CPU devices stand in for a TPU in a TPU-shaped session, but only where this host has
    no TPU chips: with chips, a CPU runtime is the wrong device there too."""
    machine_shape, kernel = _built_for.get("machine_shape", ""), _built_for.get("kernel", "")
    if not machine_shape.lower().startswith("tpu") or device_type == "TPU":
        return
    from shared.tpu import tpu_devices_present

    chips = tpu_devices_present()
    if is_local_kaggle() and device_type == "CPU" and not chips and _local_session_is_tpu()[0]:
        return
    seen = (f"although this host has TPU chips (PJRT_DEVICE={os.environ.get('PJRT_DEVICE', 'unset')})" if chips
            else "and this host has no TPU chips")
    raise UserError(f"this {kernel} kernel was built for a TPU ({machine_shape}) but its runtime started on "
                    f"{device_type} {seen}; stopping before any step. Check the notebook's accelerator setting, "
                    f"and leave PJRT_DEVICE unset or TPU")
