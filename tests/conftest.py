"""Fixtures every test folder may use: the environment of torch_xla's CPU backend (8 devices; the runtime itself
starts only in the folders that train or evaluate in this process: train/ and eval/), GPT-2 ranks from the
package index, a real-text corpus in llm.c shards, one uninterrupted training run, the Kaggle image
stand-ins, and a busy core beside a test. Plain helpers live in helpers.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("WANDB_MODE", "disabled")
# --plan and a chain's start compile the train step for the TPU (minutes for gpt2): only the tests that ask for it
# (tests/train/test_tpu_compile.py) turn the TPU compiler on.
os.environ.setdefault("TPU_COMPILER_PYTHON", "off")

from helpers import IMAGE_PYTHONS, made_once, train_cli  # noqa: E402


@pytest.fixture(scope="session")
def suite_xla_runtime():
    """torch_xla's runtime (SPMD over the 8 CPU devices), started once per process. torch's autograd engine sizes
    its per-device queues at the first backward pass, and a backend whose devices appear after that (torch_xla's)
    then fails its first backward: train/ and eval/, which mix CPU and XLA runs in one process, start it before
    their first test (their conftest.py), and no other folder starts it."""
    from shared.train.device import make_runtime

    return make_runtime("xla")


@pytest.fixture(scope="session")
def gpt2_ranks() -> Path:
    from shared.tokenize.tokenizer import fetch_gpt2_ranks

    return fetch_gpt2_ranks()


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory, gpt2_ranks) -> Path:
    from shared.tokenize.demo_corpus import build_demo_corpus

    return made_once(tmp_path_factory, "demo_data", lambda out: build_demo_corpus(
        out, shard_tokens=100_000, val_tokens=20_000, ranks_path=gpt2_ranks, max_chars=1_000_000))


@pytest.fixture(scope="session")
def straight_run(demo_data, tmp_path_factory) -> Path:
    """6 uninterrupted steps of kernels/train.py (helpers.py's small settings): what resumed runs must equal, in
    train/test_train.py and chain/test_build_kernels.py alike, so it is run once (on one worker)."""
    def make(out: Path) -> None:
        proc = train_cli(demo_data, out, "--max-steps", "6")
        assert proc.returncode == 0, proc.stderr[-3000:]

    return made_once(tmp_path_factory, "straight_run", make)


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


@pytest.fixture
def cpu_hog():
    """A busy loop on one core beside the test (a laptop busy with something else), from the test's start until
    the test kills it (`cpu_hog.kill()`) or ends."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield hog
    hog.kill()
    hog.wait()
