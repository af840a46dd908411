"""Fixtures every test folder may use: the environment of torch_xla's CPU backend (8 devices; the runtime itself
starts only in the folders that train or evaluate in this process: train/ and eval/), GPT-2 ranks from the
package index, a real-text corpus in llm.c shards, one uninterrupted training run, the Kaggle image
stand-ins, and a core taken from a test. Plain helpers live in helpers.py."""

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("WANDB_MODE", "disabled")
# --plan and a chain's start compile the train step for the TPU (minutes for gpt2): only the tests that ask for it
# (tests/train/test_tpu_compile.py) turn the TPU compiler on.
os.environ.setdefault("TPU_COMPILER_PYTHON", "off")

from helpers import IMAGE_PYTHONS, BusyCore, long_tests_first, made_once, run_lock, train_cli  # noqa: E402


@pytest.fixture(scope="session")
def suite_xla_runtime():
    """torch_xla's runtime (SPMD over the 8 CPU devices), started once per process. torch's autograd engine sizes
    its per-device queues at the first backward pass, and a backend whose devices appear after that (torch_xla's)
    then fails its first backward: train/ and eval/, which mix CPU and XLA runs in one process, start it before
    their first test (their conftest.py), and no other folder starts it."""
    from shared.runtime.device import make_runtime

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
        proc = train_cli(demo_data, out, "--total-steps", "6")
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
def busy_core(tmp_path_factory):
    """One core taken from the test (helpers.BusyCore), from its start until the test calls `busy_core.end()` or
    ends. One such test runs at a time: two at once on a 2-core machine would share the one core left, and the
    suite's time would depend on that chance. The tests that use it share an xdist group (one worker runs them in
    turn, see `pytest_collection_modifyitems`); the lock holds that however the suite is run."""
    with run_lock(tmp_path_factory, "busy-core"):
        taken = BusyCore()
        try:
            yield taken
        finally:
            taken.end()


# Where the suite's time goes: each test's measured seconds (setup, call and teardown), from an idle run of the
# whole suite on 2 cores (`pytest -n 2 --record-durations tests/durations.json`). The longest start first, so
# that a two-worker run does not end with one worker alone on a 7-minute test; the rest keep their order.
DURATIONS = Path(__file__).parent / "durations.json"
LONG_TEST_S = 30.0


def pytest_addoption(parser):
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test's measured seconds (setup + call + teardown) to PATH as JSON")


@pytest.hookimpl(tryfirst=True)  # before xdist adds the group to the test's id
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "busy_core" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("busy_core"))
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    items[:] = long_tests_first(items, measured, LONG_TEST_S)


def pytest_configure(config):
    path = config.getoption("--record-durations")
    if path and not hasattr(config, "workerinput"):  # the controller writes, from every worker's reports
        config.pluginmanager.register(DurationRecorder(Path(path)), "duration-recorder")


class DurationRecorder:
    def __init__(self, path: Path):
        self.path, self.seconds = path, {}

    def pytest_runtest_logreport(self, report):
        nodeid = report.nodeid.split("@", 1)[0]  # xdist's loadgroup appends "@group"
        self.seconds[nodeid] = self.seconds.get(nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        rounded = {k: round(v, 1) for k, v in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        self.path.write_text(json.dumps(rounded, indent=0) + "\n")
