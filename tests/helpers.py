"""Helpers the test folders share: running repo scripts as a user would (a new process), the Kaggle image
stand-ins' interpreters, a kernel's `error:` lines, test_train's small training runs (used by train, chain and
eval tests alike), `made_once` for a fixture's run that both xdist workers read, and `BusyCore` (a core taken from
a test). Importable from every test module: pyproject puts tests/ on sys.path."""

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file

from shared.config import TrainConfig
from shared.train.checkpoint import list_checkpoints
from shared.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent


def example_config(name: str) -> dict:
    """examples/<name> as a dict, its `train` settings flat (the file nests them by section), so a test may lay
    its own settings over them by key."""
    import json

    from shared.train_sections import flatten_sections

    raw = json.loads((REPO / "examples" / name).read_text())
    return {**raw, "train": flatten_sections(raw["train"], f"examples/{name}: train")}


def run_script(path: str, *args: str, timeout: float = 300, env: dict | None = None,
               python: str = sys.executable) -> subprocess.CompletedProcess:
    """Run a repo script in a fresh Python process (this one's interpreter unless told), as a user would."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run([python, str(REPO / path), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=REPO)


IMAGE_PYTHONS = {"tpu": REPO / ".venv-kaggle-tpu" / "bin" / "python",
                 "cpu": REPO / ".venv-kaggle-cpu" / "bin" / "python"}


def importable_in(python: Path, modules: tuple[str, ...]) -> list[str]:
    """Which of `modules` the interpreter `python` finds (nothing imported)."""
    code = "import importlib.util, sys; print(','.join(m for m in sys.argv[1:] if importlib.util.find_spec(m)))"
    out = subprocess.run([str(python), "-c", code, *modules], capture_output=True, text=True, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def error_lines(stderr: str) -> list[str]:
    """The `error:` lines a kernel printed (library warnings from torch_xla are ignored)."""
    return [line for line in stderr.splitlines() if line.startswith("error:")]


SMALL_ARGS = ["--preset", "tiny", "--seq-len", "32", "--micro-batch", "8", "--total-batch-tokens", "512",
              "--warmup-steps", "2", "--log-every", "1", "--eval-every", "0", "--no-progress",
              "--wandb-project", "", "--backend", "xla"]


def train_config(**settings) -> TrainConfig:
    """A TrainConfig from settings by name (`lr=1e-3`, each name one section's): TrainConfig.from_dict, shorter."""
    return TrainConfig.from_dict(settings)


def small_config(data_dir, out_dir, **overrides) -> TrainConfig:
    cfg = train_config(preset="tiny", seq_len=32, micro_batch=8, total_batch_tokens=512, warmup_steps=2,
                       log_every=1, eval_every=0, progress=False, wandb_project="", data_dir=str(data_dir),
                       out_dir=str(out_dir), total_steps=6, checkpoint_every=0)
    return cfg.replace(**overrides)


def train_in_process(cfg: TrainConfig, attention=None):
    """A session on the suite's XLA runtime; `attention`: an AttentionChoice to train with (None: selected)."""
    from shared.runtime.device import make_runtime
    from shared.train.trainer import train

    lines = []
    return train(cfg, make_runtime("xla"), log=lines.append, attention=attention), lines


def final_tensors(out_dir: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(Path(out_dir) / "checkpoints")[-1]
    tensors = load_file(newest / "model.safetensors")
    tensors.update({f"opt.{k}": v for k, v in load_file(newest / "optimizer.safetensors").items()})
    return tensors


def loss_history(out_dir: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in read_metrics(Path(out_dir) / "metrics.jsonl")
            if "loss" in r]


def assert_identical_runs(a: Path, b: Path, steps: int) -> None:
    ta, tb = final_tensors(a), final_tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert torch.equal(ta[name], tb[name]), f"{name} differs"
    history = loss_history(a)
    assert [h[0] for h in history] == list(range(1, steps + 1))
    assert history == loss_history(b)


def train_cli(data_dir, out_dir, *extra, timeout=300):
    return run_script("kernels/train.py", "--data-dir", str(data_dir), "--out-dir", str(out_dir), *SMALL_ARGS,
                      *extra, timeout=timeout)


def run_folder(tmp_path_factory) -> Path:
    """This test run's folder, which every xdist worker shares (each worker's own basetemp lies under it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@contextmanager
def run_lock(tmp_path_factory, name: str) -> Iterator[None]:
    """Held by one test of the run at a time, across xdist workers: the others wait at the `with`."""
    folder = run_folder(tmp_path_factory) / "made-once"
    folder.mkdir(exist_ok=True)
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def long_tests_first(items: list, seconds: dict[str, float], at_least: float) -> list:
    """The tests measured at `at_least` seconds or more, longest first, then the others in their own order."""
    long = sorted((i for i in items if seconds.get(i.nodeid, 0.0) >= at_least), key=lambda i: -seconds[i.nodeid])
    return long + [i for i in items if seconds.get(i.nodeid, 0.0) < at_least]


def made_once(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `make` once per test run: under xdist the workers share it (the first to
    come makes it while the others wait on a lock), so a training run that tests on both workers read is not
    run twice. A `make` that fails leaves nothing behind, and the next test to ask tries again."""
    root = run_folder(tmp_path_factory)
    out, done = root / "made-once" / name, root / "made-once" / f"{name}.done"
    with run_lock(tmp_path_factory, name):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                make(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            done.touch()
    return out


class BusyCore:
    """One of the machine's cores taken from a test (a laptop busy with something else) by CPU affinity, not by a
    busy loop: every thread of this process and of each process under it, and so each process they start, runs
    on the other cores until `end()`. As harsh for the test as a loop spinning on that core (never kinder: a loop
    would leave the test the core's share it wins from it), and it burns no CPU the suite's other worker needs.
    On a one-core machine nothing is taken."""

    def __init__(self):
        self.allowed = os.sched_getaffinity(0)
        self.left = set(sorted(self.allowed)[1:]) or self.allowed
        self._pin(self.left)

    def end(self) -> None:
        """Every core back, to this process and each under it still running."""
        self._pin(self.allowed)

    @staticmethod
    def _pin(cpus: set[int]) -> None:
        for pid in (os.getpid(), *descendants(os.getpid())):
            for tid in threads_of(pid):
                try:
                    os.sched_setaffinity(tid, cpus)
                except (ProcessLookupError, PermissionError):  # ended since it was listed, or not ours to move
                    pass


def threads_of(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return []


def descendants(pid: int) -> list[int]:
    """The processes under `pid` (children, theirs, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the command's name, which may hold spaces
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found
