"""Shared fixtures: torch_xla's CPU backend with 8 devices, GPT-2 ranks from the package index, a real-text
corpus in llm.c shards, the tokenize tests' corpus (tokenize_fixtures.py), and a helper to run kernels as a user
would (a new process)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("WANDB_MODE", "disabled")

REPO = Path(__file__).resolve().parent.parent

# torch's autograd engine sizes its per-device queues at the first backward pass; a backend whose devices
# appear after that (torch_xla's) then fails its first backward. Tests mix CPU and XLA runs in one process, so
# the XLA runtime (SPMD over the 8 CPU devices) starts before any test runs.
from shared.train.device import make_runtime  # noqa: E402

make_runtime("xla")

# The tokenize tests' session fixtures, here so that both of their files share one corpus and one reference run.
from tokenize_fixtures import corpus, enc, ranks, reference  # noqa: E402, F401


@pytest.fixture(scope="session")
def gpt2_ranks() -> Path:
    from shared.tokenize.tokenizer import fetch_gpt2_ranks

    return fetch_gpt2_ranks()


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory, gpt2_ranks) -> Path:
    from shared.tokenize.demo_corpus import build_demo_corpus

    out = tmp_path_factory.mktemp("demo_data")
    build_demo_corpus(out, shard_tokens=100_000, val_tokens=20_000, ranks_path=gpt2_ranks, max_chars=1_000_000)
    return out


@pytest.fixture(scope="session")
def straight_run(demo_data, tmp_path_factory) -> Path:
    """6 uninterrupted steps of kernels/train.py (test_train's small settings): what resumed runs must equal, in
    test_train.py and test_build_kernels.py alike, so it is run once."""
    from test_train import train_cli

    out = tmp_path_factory.mktemp("straight")
    proc = train_cli(demo_data, out, "--max-steps", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def run_script(path: str, *args: str, timeout: float = 300, env: dict | None = None,
               python: str = sys.executable) -> subprocess.CompletedProcess:
    """Run a repo script in a fresh Python process (this one's interpreter unless told), as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([python, str(REPO / path), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)


IMAGE_PYTHONS = {"tpu": REPO / ".venv-kaggle-tpu" / "bin" / "python",
                 "cpu": REPO / ".venv-kaggle-cpu" / "bin" / "python"}


@pytest.fixture(scope="session")
def image_pythons() -> dict[str, Path]:
    """The interpreters standing in for Kaggle's TPU and CPU images (`bash scripts/setup.sh --kaggle-image`, which
    CI runs): missing, a test that needs them fails in CI and is skipped elsewhere."""
    missing = [str(p) for p in IMAGE_PYTHONS.values() if not p.exists()]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{', '.join(missing)} missing: CI must run `bash scripts/setup.sh --kaggle-image`")
        pytest.skip("no Kaggle image interpreters: run `bash scripts/setup.sh --kaggle-image`")
    return IMAGE_PYTHONS


def importable_in(python: Path, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` the interpreter `python` finds (nothing imported)."""
    code = "import importlib.util, sys; print(','.join(m for m in sys.argv[1:] if importlib.util.find_spec(m)))"
    out = subprocess.run([str(python), "-c", code, *modules], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def error_lines(stderr: str) -> list[str]:
    """The `error:` lines a kernel printed (library warnings from torch_xla are ignored)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]
