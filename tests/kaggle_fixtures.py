"""Fixtures and helpers for tests that drive the real `kaggle` CLI against the local Kaggle.

Not a conftest: import what you need explicitly, e.g.

    from kaggle_fixtures import write_kernel

The `local_kaggle` fixture reaches tests through the conftest.py of tests/chain/ and tests/local_kaggle/.

(pytest puts tests/ on sys.path for test modules there, as tests/ has no __init__.py.)

`local_kaggle` starts `scripts.local_kaggle`'s server in this process (a thread) on a free port, with a
fresh root, user "alice" (key "alice-key"), short queue delay; `lk.cli(...)` runs the real CLI in a subprocess
with an isolated HOME/config and the environment that points it at the server (`lk.env`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KAGGLE_BIN = Path(sys.executable).with_name("kaggle")
USER, KEY = "alice", "alice-key"


def load_local_kaggle_module():
    """The `scripts.local_kaggle` package, imported with the repository root on sys.path."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from scripts import local_kaggle

    return local_kaggle


def client_env(app, home: Path, user: str | None = USER, key: str | None = KEY) -> dict[str, str]:
    """os.environ, minus any Kaggle credentials/proxies, plus what points the client at `app`."""
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("KAGGLE_", "LOCAL_KAGGLE_")) and k.lower() not in
        {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}
    }
    env.update(app.client_env(user, key))
    home.mkdir(parents=True, exist_ok=True)
    env["HOME"] = str(home)  # no ~/.kaggle/kaggle.json or access_token of the machine's user
    env["KAGGLE_CONFIG_DIR"] = str(home / "kaggle-config")
    env["TMPDIR"] = str(home)  # the client keeps resumable-upload state under $TMPDIR/.kaggle
    env["PYTHONUNBUFFERED"] = "1"
    return env


@dataclass
class LocalKaggleHandle:
    app: object  # scripts.local_kaggle.LocalKaggle
    root: Path
    home: Path
    env: dict

    def cli(self, *args: str, check: bool = True, env: dict | None = None, cwd: Path | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        """Run the real kaggle CLI; check=True asserts exit code 0 and shows its output if not."""
        proc = subprocess.run([str(KAGGLE_BIN), *args], env=env or self.env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)
        if check:
            assert proc.returncode == 0, f"kaggle {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def python(self, code: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        """Run Python code (e.g. KaggleApi calls) in a subprocess with the client environment."""
        proc = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=self.home)
        if check:
            assert proc.returncode == 0, f"python -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        return proc

    def wait(self, ref: str, timeout: float = 30.0) -> tuple[str, str | None]:
        status, message = self.app.wait_kernel(ref, timeout)
        assert status in {"COMPLETE", "ERROR", "CANCEL_ACKNOWLEDGED"}, f"{ref} still {status} after {timeout}s"
        return status, message

    def restart(self, **kwargs) -> None:
        """Stop the server and start a new one on the same root (a new port)."""
        self.app.stop()
        self.app = start_app(self.root, **kwargs)
        self.env = client_env(self.app, self.home)


def start_app(root: Path, **kwargs):
    module = load_local_kaggle_module()
    options = {"queue_delay_s": 0.2, "users": {USER: KEY}}
    options.update(kwargs)
    return module.LocalKaggle(root, **options).start()


@pytest.fixture
def local_kaggle(tmp_path):
    root, home = tmp_path / "kaggle-root", tmp_path / "home"
    app = start_app(root)
    handle = LocalKaggleHandle(app=app, root=root, home=home, env=client_env(app, home))
    try:
        yield handle
    finally:
        handle.app.stop()


def write_kernel(folder: Path, ref: str, code: str, *, kernel_type: str = "script", **meta) -> Path:
    """A kernel folder for `kaggle kernels push -p folder`: the code file and kernel-metadata.json."""
    folder.mkdir(parents=True, exist_ok=True)
    slug = ref.split("/")[1]
    # A session runs in its image's interpreter, which has no `shared`: a built kernel embeds it, these use the
    # checkout's.
    code = f"import sys\nsys.path.insert(0, {str(REPO)!r})\n" + code
    if kernel_type == "notebook":
        code_file = "kernel.ipynb"
        cells = [{"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "source": c}
                 for c in code.split("\n# %%\n")]
        (folder / code_file).write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                                    "nbformat_minor": 5}))
    else:
        code_file = "kernel.py"
        (folder / code_file).write_text(code)
    metadata = {
        "id": ref,
        "title": slug.replace("-", " "),
        "code_file": code_file,
        "language": "python",
        "kernel_type": kernel_type,
        "is_private": True,
        "enable_internet": False,
        "dataset_sources": [],
        "kernel_sources": [],
        "competition_sources": [],
    }
    metadata.update(meta)
    (folder / "kernel-metadata.json").write_text(json.dumps(metadata, indent=1))
    return folder


def write_dataset(folder: Path, ref: str, files: dict[str, bytes | str], title: str | None = None) -> Path:
    """A dataset folder for `kaggle datasets create/version -p folder` holding exactly `files`."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        if old.is_file():
            old.unlink()
    for name, data in files.items():
        (folder / name).write_bytes(data.encode() if isinstance(data, str) else data)
    slug = ref.split("/")[1]
    meta = {"id": ref, "title": title or slug.replace("-", " ").title(), "licenses": [{"name": "CC0-1.0"}]}
    (folder / "dataset-metadata.json").write_text(json.dumps(meta))
    return folder


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s")


def save_without_running(lk: LocalKaggleHandle, folder: Path) -> int:
    """Save the kernel in `folder` as a new version without running it (kagglesdk's QUICK_SAVE, as the chain does
    before a notebook's first session); returns the version number."""
    meta = json.loads((folder / "kernel-metadata.json").read_text())
    reply = lk.app.api(USER, "kernels.KernelsApiService", "SaveKernel", {
        "slug": meta["id"], "newTitle": meta["title"], "text": (folder / meta["code_file"]).read_text(),
        "language": "python", "kernelType": meta["kernel_type"], "kernelExecutionType": "QUICK_SAVE"})
    return reply["versionNumber"]

