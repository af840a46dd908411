"""The suite's own time: its busy-core tests never run at once, the longest tests start first, and a run can
record where its time went (tests/conftest.py)."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import REPO, BusyCore, descendants, long_tests_first

# Two tests with a busy core beside them and two without, each noting when it ran and on which worker; the busy
# ones first, where two free workers would each take one.
BUSY_SUITE = '''
import os, time
from pathlib import Path

def note(name):
    start = time.monotonic()
    time.sleep(1.5)
    Path(name + ".json").write_text(repr((os.environ.get("PYTEST_XDIST_WORKER"), start, time.monotonic())))

def test_busy_a(busy_core):
    note("busy_a")

def test_busy_b(busy_core):
    note("busy_b")

def test_plain_a():
    note("plain_a")

def test_plain_b():
    note("plain_b")
'''


def test_a_busy_core_takes_one_core_from_the_tests_threads_and_processes_and_gives_it_back():
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("one core: none to take")
    left = set(sorted(allowed)[1:])
    # Started before the core is taken: a thread of this process, a child and the child's own child.
    started, stop = threading.Event(), threading.Event()
    native = []
    thread = threading.Thread(target=lambda: (native.append(threading.get_native_id()), started.set(), stop.wait()))
    thread.start()
    started.wait()
    child = subprocess.Popen(["sh", "-c", "sleep 60 & wait"])
    try:
        for _ in range(100):  # the shell starts its sleep
            if descendants(child.pid):
                break
            threading.Event().wait(0.05)
        (grandchild,) = descendants(child.pid)
        taken = BusyCore()
        try:
            assert os.sched_getaffinity(0) == left and os.sched_getaffinity(native[0]) == left
            assert os.sched_getaffinity(child.pid) == left and os.sched_getaffinity(grandchild) == left
            # ... and a process started after: it inherits the cores left.
            after = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                   capture_output=True, text=True, check=True)
            assert after.stdout.strip() == str(sorted(left))
        finally:
            taken.end()
        for pid in (0, native[0], child.pid, grandchild):
            assert os.sched_getaffinity(pid) == allowed, pid
    finally:
        for pid in descendants(child.pid):
            os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()
        stop.set()
        thread.join()


def test_the_busy_core_tests_run_in_turn_on_one_worker_while_the_other_worker_runs_the_rest(tmp_path):
    # The repo's own conftest and pytest settings (pyproject's addopts), over a suite of four tests.
    (tmp_path / "conftest.py").write_text(
        "import importlib.util, sys\n"
        f"sys.path.insert(0, {str(REPO / 'tests')!r})\n"
        f"spec = importlib.util.spec_from_file_location('repo_conftest', {str(REPO / 'tests' / 'conftest.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "globals().update({k: v for k, v in vars(module).items() if not k.startswith('__')})\n")
    (tmp_path / "test_busy.py").write_text(BUSY_SUITE)
    record = tmp_path / "durations.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-q", "-n", "2", "-p", "no:cacheprovider", "--record-durations",
                           str(record), str(tmp_path / "test_busy.py")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = {name: eval((tmp_path / f"{name}.json").read_text())
           for name in ("busy_a", "busy_b", "plain_a", "plain_b")}
    (worker_a, start_a, end_a), (worker_b, start_b, end_b) = ran["busy_a"], ran["busy_b"]
    assert worker_a == worker_b and worker_a is not None
    assert end_a <= start_b or end_b <= start_a
    seconds = json.loads(record.read_text())
    assert sorted(seconds) == sorted(f"test_busy.py::test_{n}" for n in ("busy_a", "busy_b", "plain_a", "plain_b"))
    assert all(1.5 <= s < 60 for s in seconds.values())


def test_the_tests_measured_long_start_first_longest_first_and_the_rest_keep_their_order():
    items = [SimpleNamespace(nodeid=n) for n in ("a", "b", "c", "d", "e")]
    seconds = {"b": 40.0, "d": 400.0, "e": 29.9, "a": 1.0}
    assert [i.nodeid for i in long_tests_first(items, seconds, 30.0)] == ["d", "b", "a", "c", "e"]


def test_the_recorded_durations_name_only_tests_that_exist():
    recorded = json.loads((REPO / "tests" / "durations.json").read_text())
    for nodeid in recorded:
        path = nodeid.split("::", 1)[0]
        assert (REPO / path).exists(), nodeid
        name = nodeid.split("::", 1)[1].split("[", 1)[0]
        assert f"def {name}(" in Path(REPO / path).read_text(), nodeid


def test_ci_says_how_busy_the_cores_were_over_the_tests_from_proc_stat(tmp_path):
    # .ci/run's own functions, sourced, over two /proc/stat readings: user nice system idle iowait irq softirq steal
    # guest guest_nice, in ticks. Between them: 600 busy ticks (guest's 50 counted in user already) and 200 idle
    # or waiting, so 75% busy.
    stat = tmp_path / "stat"
    first = "cpu  1000 0 500 8000 100 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    later = "cpu  1450 0 600 8150 150 20 30 0 50 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"
    script = (f"source {REPO / '.ci' / 'run'}; stat={stat}; cat {stat}.1 > $stat; read -r t i < <(cpu_ticks); "
              f"echo $t $i; cat {stat}.2 > $stat; busy_since $t $i")
    stat.with_suffix(".1").write_text(first)
    stat.with_suffix(".2").write_text(later)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "PROC_STAT": str(stat)})
    assert proc.returncode == 0, proc.stderr
    ticks, line = proc.stdout.splitlines()
    assert ticks == "9600 8100"
    hz = int(subprocess.run(["getconf", "CLK_TCK"], capture_output=True, text=True).stdout)
    cores = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout)
    assert line == (f"ci: over the tests the {cores} cores were 75% busy: {600 / hz:.0f} of the {800 / hz:.0f} "
                    "CPU-seconds they had")


def test_ci_names_the_processes_that_used_the_cpu_before_the_tests_and_only_those():
    # .ci/run's own `machine`, sourced, beside a busy loop it must name: a row for each process that used some CPU
    # over top's second, none of the idle ones (an idle machine's kernel threads at 0.0).
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = subprocess.run(["bash", "-c", f"source {REPO / '.ci' / 'run'}; machine"], capture_output=True,
                              text=True, timeout=60)
    finally:
        busy.kill()
        busy.wait()
    assert proc.returncode == 0, proc.stderr
    load, said, header, *rows = proc.stdout.splitlines()
    assert load.startswith("ci: ") and " cores; load average (1, 5, 15 min): " in load
    assert said == "ci: the processes using the most CPU over one second:"
    assert header.split()[8] == "%CPU" and header.split()[-1] == "COMMAND"
    assert 1 <= len(rows) <= 7
    assert all(float(row.split()[8]) > 0 for row in rows), rows
    assert any(row.split()[0] == str(busy.pid) for row in rows), rows
