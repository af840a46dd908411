"""What a kernel imports that a Kaggle image may lack, and getting it at session start, before any work.

Kaggle's TPU image has no `kaggle`, `tiktoken` or `wandb`, and no primary source shows `tiktoken` or `wandb` in
its CPU image (docs/kaggle-tpu.md, section 5). The bootstrap of a built kernel asks for what that kernel needs
(`require`; `provide` for an optional one, such as W&B's). A missing package is installed then, pinned, with
pip's `--target` into the session's temp folder: it goes with the session, as Kaggle's own `pip install` does,
and the image is never changed. That folder goes at the end of the import path, so the image's own packages win
over the copies pip puts beside ours; only where an older copy in the image breaks the package (checked by
importing it in a fresh interpreter) does it go first.

With internet off pip fails within seconds: a required package is then one line and exit 2 (UserError), an
optional one a one-line notice; an install that hangs is stopped at PIP_TIMEOUT_S, the same way. Outside a
Kaggle session nothing is installed: the laptop's setup has everything.

A package the image has is used as it is. (The CPU image's datasets 4.0.0 is not replaced: every datasets from 4.4.1
on needs pyarrow >= 21, and the image has 18.1.0; docs/tokenize.md, "Which library versions a session reads with".)
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.errors import UserError, duration_text
from shared.kaggle.facts import record_fact

TARGET_DIR = "gpt2k-packages"  # under the session's temp folder
# One pip install, whole: pip's own --timeout is per socket read, so an index that trickles bytes (or a proxy that
# accepts and never answers, retried) could hold a session's start-up well past its margin (420-600 s).
PIP_TIMEOUT_S = 240.0
IMPORT_CHECK_TIMEOUT_S = 120.0  # a fresh interpreter importing a package (datasets: 1-2 s)
_installs_s: list[float] = []  # this process's installs, for the trainer's start-up line


@dataclass(frozen=True)
class Package:
    """One import a kernel may need, and the pinned requirements that provide it."""

    module: str  # the import name
    requirements: tuple[str, ...]  # pinned pip requirements
    purpose: str  # what it is for, in the notices
    check: str = ""  # the import that proves an install works (default: `import <module>`)
    # Tried first, where set: the package and what it imports that an image may lack, pinned and installed without
    # resolving (pip --no-deps), the rest taken from the image. `check` decides; if it fails, `requirements` with
    # their whole closure. (pip's --target installs a package's whole closure whatever the image has: kaggle 2.2.4
    # and six are 34 packages, jupytext among them, 11-14 s in the TPU image's stand-in; these 10, 4-6 s.)
    fast: tuple[str, ...] = ()


# The versions the project's own setup installs and tests with (pyproject.toml pins the same; a test checks).
PACKAGES = {
    "tiktoken": Package("tiktoken", ("tiktoken==0.14.0",), "GPT-2's tokenizer",
                        "import tiktoken.load, tiktoken_ext.openai_public"),
    # The kaggle wheel imports six without declaring it; importing it authenticates (dummy credentials suffice).
    "kaggle": Package("kaggle", ("kaggle==2.2.4", "six==1.17.0"), "publishing checkpoints to a Kaggle dataset",
                      "import kaggle.api.kaggle_api_extended, dateutil.tz",
                      # kaggle 2.2.4's kaggle_api_extended.py imports these (lines 39-60) beside requests, urllib3,
                      # tqdm, protobuf and packaging, which the TPU image has (with kagglehub: docs/kaggle-tpu.md)
                      fast=("kaggle==2.2.4", "six==1.17.0", "kagglesdk==0.1.38", "bleach==6.4.0",
                            "webencodings==0.6.1", "python-dotenv==1.2.4", "python-slugify==9.2.0",
                            "text-unidecode==1.3", "python-dateutil==4.0.0", "tzdata==2026.6")),
    "wandb": Package("wandb", ("wandb==0.31.0",), "W&B logging"),
    # torch_xla's call_jax (jax's splash attention, shared/model/splash.py) needs it beside jax. torch_xla's wheel
    # carries a copy (which imports with the TPU image's torch_xla 2.8.0 and jax 0.7.2: docs/tpu-throughput.md).
    "torchax": Package("torchax", ("torchax==0.0.13",), "jax's splash attention (torch_xla's call_jax)"),
}


def importable(module: str) -> bool:
    """Whether `module` can be imported here (found on the import path; nothing is imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def pip_install(requirements: tuple[str, ...], target: Path, no_deps: bool = False) -> str | None:
    """Install into `target`; None on success, else pip's last error line. `no_deps`: these requirements alone.
    (What is in `target` already stays: --target with --upgrade would replace shared folders such as bin/ whole.)"""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input",
           "--retries", "1", "--timeout", "15", "--target", str(target), *(["--no-deps"] if no_deps else []),
           *requirements]
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"ERROR: pip install ran past {duration_text(PIP_TIMEOUT_S)} and was stopped"
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")] or lines or [f"pip exited {proc.returncode}"]
    return errors[-1][:300]


def _imports_with(path: list[str], check: str) -> str | None:
    """Run `check` in a fresh interpreter whose import path is `path`: None if it imports, else its last error line.
    (A fresh process: a failed import here would leave half-imported modules behind.)"""
    code = f"import sys, json; sys.path[:] = json.loads(sys.argv[1]); {check}"
    env = {**os.environ, "KAGGLE_USERNAME": "import-check", "KAGGLE_KEY": "import-check"}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(path)], capture_output=True, text=True,
                              env=env, stdin=subprocess.DEVNULL, timeout=IMPORT_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"the import check ran past {duration_text(IMPORT_CHECK_TIMEOUT_S)} and was stopped"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.splitlines() if line.strip()] or [f"exit {proc.returncode}"]
    return lines[-1].strip()[:300]


def _place(pkg: Package, target: str) -> tuple[str | None, str]:
    """Put `target` on the import path where `pkg` imports from it: after the image's packages (so they win), or,
    where an older copy of a dependency in the image breaks it (kaggle 2.2.4 needs kagglesdk 0.1.35 or later, and
    the TPU image has whatever kagglehub brought), before them. (error or None, where it went)."""
    check = pkg.check or f"import {pkg.module}"
    base = [p for p in sys.path if p != target]
    after = _imports_with(base + [target], check)
    if after is not None:
        before = _imports_with([target] + base, check)
        if before is not None:
            return after, ""
    sys.path[:] = base + [target] if after is None else [target] + base
    importlib.invalidate_caches()
    return None, ("after the image's packages" if after is None else
                  f"before the image's packages, which break it after them ({after})")


def _install(pkg: Package, target: Path, installer) -> tuple[str | None, str | None, str, bool]:
    """Install `pkg` into `target` and place it on the import path: its `fast` set first, where it has one, then
    its whole closure. -> (pip's error, the import check's error, where the folder went on the import path,
    whether the fast set was enough)."""
    if pkg.fast and installer(pkg.fast, target, no_deps=True) is None:
        error, where = _place(pkg, str(target))
        if error is None:
            return None, None, where, True
    pip_error = installer(pkg.requirements, target)
    if pip_error is not None:
        return pip_error, None, "", False
    return (None, *_place(pkg, str(target)), False)


def install_dir() -> Path | None:
    """The session's folder for installed packages; None outside a Kaggle (or local Kaggle) session."""
    from shared.kaggle.env import in_session, kaggle_paths

    return kaggle_paths().temp / TARGET_DIR if in_session() else None


def provide(name: str, reason: str = "", log=print, installer=None) -> str | None:
    """Make PACKAGES[name] importable: already, or installed now into the session's temp folder. None when it
    is; otherwise one line saying why not. `reason`: what this kernel needs it for."""
    pkg = PACKAGES[name]
    if importable(pkg.module):
        record_fact("packages", name, {"from": "image"})
        return None
    why = reason or pkg.purpose
    target = install_dir()
    if target is None:
        return f"the {pkg.module} package is not installed (needed for {why}): pip install {' '.join(pkg.requirements)}"
    start = time.monotonic()
    target.mkdir(parents=True, exist_ok=True)
    error, import_error, where, fast = _install(pkg, target, installer or pip_install)
    if error is None:
        if import_error is None:
            seconds = time.monotonic() - start
            _installs_s.append(seconds)
            record_fact("packages", name, {"from": "installed", "requirements": pkg.fast if fast else pkg.requirements,
                                           "fast": fast, "seconds": round(seconds, 1)})
            log(f"installed {', '.join(pkg.requirements)} for {why} in {seconds:.1f}s "
                f"(not in this image; into {target}, {where}, gone with the session"
                + (f"; with {len(pkg.fast) - len(pkg.requirements)} of its dependencies, pinned, the rest the "
                   "image's)" if fast else ")"))
            return None
        problem = (f"the {pkg.module} package is not in this Kaggle image, and the copy pip installed into {target} "
                   f"does not import ({import_error}); it is needed for {why}")
    else:
        problem = (f"the {pkg.module} package is not in this Kaggle image and could not be installed ({error}); it "
                   f"is needed for {why}: turn on the notebook's internet (Settings > Internet)")
    record_fact("packages", name, {"from": "missing", "problem": problem})
    return problem


def installed_seconds() -> float:
    """The seconds this process spent installing packages (`provide`)."""
    return sum(_installs_s)


def require(name: str, reason: str = "", log=print, installer=None) -> None:
    """`provide`, or one line and exit 2 (UserError) before any work."""
    problem = provide(name, reason, log, installer)
    if problem:
        raise UserError(f"{problem}; stopping before any work")
