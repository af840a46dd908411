"""The tokenize kernel as a user runs it: a script in a new process, killed and restarted byte-identically, and
bad input answered with one line and exit code 2, losing nothing (issue 4)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenize_fixtures import (
    KERNEL,
    ROOT,
    assert_same_shards,
    kernel_args,
    kernel_error,
    run_kernel,
    run_tokenize,
    snapshot,
)

from shared.tokenize.manifest import MANIFEST
from shared.tokenize.part import CRASH_ENV


def test_kernel_runs_as_a_script(corpus, ranks, tmp_path, reference):
    """`python kernels/tokenize.py` must not shadow the stdlib tokenize module that datasets needs."""
    out = tmp_path / "out"
    proc = run_kernel(*kernel_args(corpus, ranks, out))
    assert proc.returncode == 0, proc.stderr
    assert f"{reference[1]['num_tokens']:,} tokens" in proc.stdout
    assert snapshot(out).keys() == snapshot(reference[0]).keys()
    for name, data in snapshot(reference[0]).items():
        if name != MANIFEST:
            assert snapshot(out)[name] == data


@pytest.mark.slow
def test_restart_after_kill_is_byte_identical(corpus, ranks, tmp_path, reference):
    out = tmp_path / "out"
    # killed right after moving its 2nd shard in, before recording it in the manifest
    proc = run_kernel(*kernel_args(corpus, ranks, out, "--batch-docs", "41"), env={CRASH_ENV: "2"})
    assert proc.returncode == 137, proc.stderr
    manifest = json.loads((out / MANIFEST).read_text())
    assert not manifest["complete"] and len(manifest["shards"]) == 1
    assert (out / "fineweb_train_000001.bin").exists()  # moved in, not recorded: redone on restart
    # killed again, resumed from the middle of a parquet file
    proc = run_kernel(*kernel_args(corpus, ranks, out, "--batch-docs", "41"), env={CRASH_ENV: "3"})
    assert proc.returncode == 137, proc.stderr
    assert len(json.loads((out / MANIFEST).read_text())["shards"]) == 3
    # a finished shard damaged while the run was down is found by its sha256 and redone
    with open(out / "fineweb_train_000002.bin", "r+b") as f:
        f.seek(2000)
        f.write(b"\x00\x01")
    manifest = run_tokenize(corpus, ranks, out, batch_docs=41)
    assert manifest["summary"]["resumed"]
    assert_same_shards(out, reference[0])


@pytest.mark.slow
def test_restart_after_sigkill_at_a_random_moment(corpus, ranks, tmp_path, reference):
    """A real SIGKILL while the run is busy; the restart is byte-identical to an uninterrupted run."""
    ref = tmp_path / "ref"
    run_tokenize(corpus, ranks, ref, shard_size=1_500, batch_docs=16)
    out = tmp_path / "out"
    args = [sys.executable, str(KERNEL), *kernel_args(corpus, ranks, out, "--shard-size", "1500", "--batch-docs",
                                                        "16")]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            try:
                if len(json.loads((out / MANIFEST).read_text())["shards"]) >= 3:
                    time.sleep(random.uniform(0.0, 0.05))  # somewhere in the middle of the next shards
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.005)
        killed = proc.poll() is None
        if killed:
            proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    if killed:
        assert not json.loads((out / MANIFEST).read_text())["complete"]
    run_tokenize(corpus, ranks, out, shard_size=1_500, batch_docs=16)
    assert_same_shards(out, ref)


# ---------------------------------------------------------------------------------------------------------
# bad input: exit code 2, one line naming the cause, nothing already written lost


def _bad_files(tmp_path: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "bad"
    d.mkdir()
    pq.write_table(pa.table({"body": ["some text", "more text"]}), d / "nocol.parquet")
    (d / "garbage.parquet").write_bytes(b"this is not a parquet file at all" * 10)
    (d / "empty.jsonl").write_bytes(b"")
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), d / "norows.parquet")
    (d / "broken.jsonl").write_text('{"text": "fine"}\n{"text": "cut off\n')
    (d / "blank.jsonl").write_text("\n  \n\n")
    return {k: str(d / v) for k, v in [("nocol", "nocol.parquet"), ("garbage", "garbage.parquet"),
                                       ("empty", "empty.jsonl"), ("norows", "norows.parquet"),
                                       ("broken", "broken.jsonl"), ("blank", "blank.jsonl")]}


@pytest.mark.parametrize("case", ["no_text_column", "garbage_file", "empty_file", "no_rows", "broken_jsonl",
                                  "blank_jsonl", "no_match", "foreign_out_dir", "other_run_in_out_dir",
                                  "part_without_prev", "prev_without_manifest", "budget_below_one_shard",
                                  "tmp_dir_inside_out_dir"])
def test_bad_input_is_one_line_and_loses_nothing(case, corpus, ranks, tmp_path, reference):
    bad = _bad_files(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    args = kernel_args(corpus, ranks, out)
    expect = {
        "no_text_column": ([*args, "--data-files", bad["nocol"]], "no text column 'text' (columns: body)"),
        "garbage_file": ([*args, "--data-files", bad["garbage"]], "garbage.parquet: unreadable parquet file"),
        "empty_file": ([*args, "--data-files", bad["empty"]], "empty.jsonl: empty input file"),
        "no_rows": ([*args, "--data-files", bad["norows"]], "no documents in the input"),
        "broken_jsonl": ([*args, "--data-files", bad["broken"]], "broken.jsonl: cannot read input"),
        "blank_jsonl": ([*args, "--data-files", bad["blank"]], "blank.jsonl: no documents in the input"),
        "no_match": ([*args, "--data-files", str(tmp_path / "nothing*.parquet")], "no file matches"),
        "foreign_out_dir": (args, "not empty and not a previous run of this part"),
        "other_run_in_out_dir": ([*args, "--shard-size", "5000"], "holds a run with shard_size=20000, not 5000"),
        "part_without_prev": ([*args, "--part", "1"], "give part 0's output directory with --prev-dir"),
        "prev_without_manifest": ([*args, "--part", "1", "--prev-dir", tmp_path / "bad"],
                                  "no manifest.json of part 0"),
        "budget_below_one_shard": ([*args, "--max-output-gb", "0.00001"], "smaller than one shard"),
        "tmp_dir_inside_out_dir": ([*args, "--tmp-dir", out / "tmp"], "must be outside --out-dir"),
    }
    argv, message = expect[case]
    if case == "foreign_out_dir":
        (out / "notes.txt").write_text("mine")
    if case == "other_run_in_out_dir":
        out.rmdir()
        out = reference[0]
        argv = [a if a != str(tmp_path / "out") else str(out) for a in argv]
    before = snapshot(out)
    code, line = kernel_error(argv)
    assert code == 2
    assert message in line, line
    assert snapshot(out) == before
    if case in ("no_text_column", "garbage_file", "empty_file", "no_match", "part_without_prev",
                "budget_below_one_shard", "tmp_dir_inside_out_dir"):
        assert not any(out.iterdir())  # refused before creating anything


def test_bad_input_from_the_command_line_exits_2(corpus, ranks, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.bin").write_bytes(b"precious")
    proc = run_kernel(*kernel_args(corpus, ranks, out))
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("error: --out-dir")
    assert (out / "keep.bin").read_bytes() == b"precious" and len(list(out.iterdir())) == 1
