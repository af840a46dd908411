"""What a kernel imports that a Kaggle image may lack, and getting it at session start, before any work.

Kaggle's TPU image has no `kaggle`, `tiktoken` or `wandb`, and no primary source shows `tiktoken` or `wandb` in
its CPU image (docs/kaggle-tpu.md, section 5). The bootstrap of a built kernel asks for what that kernel needs
(`ensure`). A missing package is installed then, pinned, with pip's `--target` into the session's temp folder:
it goes with the session, as Kaggle's own `pip install` does, and the image is never changed. That folder goes
at the end of the import path, so the image's own packages always win over the copies pip puts beside ours.

With internet off pip fails within seconds: a required package is then one line and exit 2 (UserError), an
optional one a one-line notice. Outside a Kaggle session nothing is installed: the laptop's setup has everything.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import UserError

TARGET_DIR = "gpt2k-packages"  # under the session's temp folder


@dataclass(frozen=True)
class Package:
    """One import a kernel may need, and the pinned requirements that provide it."""

    module: str  # the import name
    requirements: tuple[str, ...]  # pinned pip requirements
    purpose: str  # what it is for, in the notices


# Pinned to the versions the project's own setup tests with (pyproject.toml's ranges; tests check the pins agree).
PACKAGES = {
    "tiktoken": Package("tiktoken", ("tiktoken==0.14.0",), "GPT-2's tokenizer"),
    # The kaggle wheel imports six without declaring it.
    "kaggle": Package("kaggle", ("kaggle==2.2.4", "six==1.17.0"), "publishing checkpoints to a Kaggle dataset"),
    "wandb": Package("wandb", ("wandb==0.31.0",), "W&B logging"),
}


def importable(module: str) -> bool:
    """Whether `module` can be imported here (found on the import path; nothing is imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _pip_install(requirements: tuple[str, ...], target: Path) -> str | None:
    """Install into `target`; None on success, else pip's last error line."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
           "--retries", "1", "--timeout", "15", "--target", str(target), *requirements]
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")] or lines or [f"pip exited {proc.returncode}"]
    return errors[-1][:300]


def install_dir() -> Path | None:
    """The session's folder for installed packages; None outside a Kaggle (or local Kaggle) session."""
    from shared.kaggle.env import in_session, kaggle_paths

    return kaggle_paths().temp / TARGET_DIR if in_session() else None


def provide(name: str, reason: str = "", log=print, installer=None) -> str | None:
    """Make PACKAGES[name] importable: already, or installed now into the session's temp folder. None when it
    is; otherwise one line saying why not. `reason`: what this kernel needs it for."""
    pkg = PACKAGES[name]
    if importable(pkg.module):
        return None
    why = reason or pkg.purpose
    target = install_dir()
    if target is None:
        return f"the {pkg.module} package is not installed (needed for {why}): pip install {' '.join(pkg.requirements)}"
    start = time.monotonic()
    target.mkdir(parents=True, exist_ok=True)
    error = (installer or _pip_install)(pkg.requirements, target)
    if error is None:
        if str(target) not in sys.path:
            sys.path.append(str(target))  # last: the image's own packages win
        importlib.invalidate_caches()
        if importable(pkg.module):
            log(f"installed {', '.join(pkg.requirements)} for {why} in {time.monotonic() - start:.1f}s "
                f"(not in this image; into {target}, gone with the session)")
            return None
        error = f"pip installed it into {target}, but it does not import"
    return (f"the {pkg.module} package is not in this Kaggle image and could not be installed ({error}); it is "
            f"needed for {why}: turn on the notebook's internet (Settings > Internet)")


def require(name: str, reason: str = "", log=print, installer=None) -> None:
    """`provide`, or one line and exit 2 (UserError) before any work."""
    problem = provide(name, reason, log, installer)
    if problem:
        raise UserError(f"{problem}; stopping before any work")
