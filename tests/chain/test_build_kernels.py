"""Self-contained kernels (scripts/build_kernels.py): one code file carrying `shared`, settings baked in, as a
script and as a notebook; a built kernel behaves exactly like kernels/<name>.py given the same inputs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, assert_identical_runs, error_lines, run_script
from kaggle_fixtures import load_local_kaggle_module

from scripts.chain.build import build_kernel, fill_metadata
from shared.errors import UserError
from shared.kaggle.checkpoint_files import checkpoint_files
from shared.train.checkpoint import list_checkpoints

TRAIN_SETTINGS = {"preset": "tiny", "seq_len": 32, "micro_batch": 8, "total_batch_tokens": 512, "warmup_steps": 2,
                  "log_every": 1, "eval_every": 0, "progress": False, "wandb_project": "", "total_steps": 6,
                  "checkpoint_every": 0, "data_dir": "{input:alice/demo-data}", "out_dir": "{working}/train"}


def session_root(base: Path, inputs: dict[str, Path]) -> Path:
    """A Kaggle-like folder (input/<slug>, working, temp) as the local Kaggle lays one out."""
    for sub in ("working", "temp"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for slug, src in inputs.items():
        shutil.copytree(src, base / "input" / slug)
    return base


def run_built(folder: Path, root: Path, timeout: float = 300,
              session_machine: str | None = None) -> subprocess.CompletedProcess:
    """Run a built kernel as a session would: `python <code file>` in working/, no arguments, no Kaggle env.

    A notebook runs as the local Kaggle runs one (its code cells, in order, as a script)."""
    meta = json.loads((folder / "kernel-metadata.json").read_text())
    code = folder / meta["code_file"]
    if meta["kernel_type"] == "notebook":
        script = root / "temp" / "notebook.py"
        script.write_text(load_local_kaggle_module().notebook_to_script(code.read_text()))
        code = script
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAGGLE_", "LOCAL_KAGGLE_"))}
    # The session gets the machine the metadata asks for, as the local Kaggle gives it (unless told otherwise).
    machine = meta.get("machine_shape", "") if session_machine is None else session_machine
    env.update(LOCAL_KAGGLE_ROOT=str(root), PYTHONUNBUFFERED="1", LOCAL_KAGGLE_ACCELERATOR=machine)
    return subprocess.run([sys.executable, str(code)], cwd=root / "working", env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_built_files_are_self_contained(tmp_path):
    out = build_kernel("train", tmp_path / "train", user="alice", slug="my-run-train", settings={"preset": "gpt2"},
                       dataset_sources=["alice/tokens"], kernel_sources=["alice/tok-part-0"], accelerator="TpuV5E8")
    meta = json.loads((out / "kernel-metadata.json").read_text())
    assert meta["id"] == "alice/my-run-train" and meta["code_file"] == "my-run-train.py"
    assert meta["machine_shape"] == "TpuV5E8" and meta["kernel_type"] == "script" and meta["enable_internet"]
    assert meta["dataset_sources"] == ["alice/tokens"] and meta["kernel_sources"] == ["alice/tok-part-0"]
    code = (out / "my-run-train.py").read_text()
    assert "from shared" in code and "_GPT2K_SHARED_ZIP" in code
    assert "BAKED_SETTINGS: dict = _GPT2K_BAKED.settings" in code
    assert "BAKED_PUBLISH = _GPT2K_BAKED.publish" in code
    compile(code, "built", "exec")
    nb = build_kernel("tokenize", tmp_path / "tok", user="alice", slug="my-run-tokens", kernel_type="notebook",
                      settings={"shard_size": 1000})
    meta = json.loads((nb / "kernel-metadata.json").read_text())
    assert meta["kernel_type"] == "notebook" and "machine_shape" not in meta  # CPU
    cells = json.loads((nb / meta["code_file"]).read_text())["cells"]
    assert [c["cell_type"] for c in cells] == ["markdown", "code", "code"]
    assert "BAKED_SETTINGS: dict = _GPT2K_BAKED.settings" in cells[2]["source"]
    assert "BAKED_PUBLISH" not in cells[2]["source"]  # only the train kernel publishes
    # The same inputs give the same build, byte for byte.
    again = build_kernel("tokenize", tmp_path / "tok2", user="alice", slug="my-run-tokens", kernel_type="notebook",
                         settings={"shard_size": 1000})
    assert (again / meta["code_file"]).read_bytes() == (nb / meta["code_file"]).read_bytes()


@pytest.mark.slow
def test_built_train_kernel_matches_kernels_train(demo_data, straight_run, tmp_path):
    """Straight 6 steps with kernels/train.py (conftest's straight_run); the built kernel: 3 steps as a script, its
    final checkpoint put into a (flat) checkpoint dataset, then 3 more as a notebook resuming from that dataset:
    bit-identical."""
    first = build_kernel("train", tmp_path / "b1", user="alice", slug="demo-train",
                         settings={**TRAIN_SETTINGS, "stop_after_steps": 3})
    root1 = session_root(tmp_path / "s1", {"demo-data": demo_data})
    proc = run_built(first, root1)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("train kernel, build ") and f"shared from {root1}" not in lines[0]
    assert "gpt2k-shared-" in lines[0]  # the embedded copy, not the repository's
    (ckpt,) = list_checkpoints(root1 / "working" / "train" / "checkpoints")  # a clean stop: one checkpoint
    assert ckpt.name == "step_000003"

    ckpt_data = tmp_path / "ckpt-data"
    ckpt_data.mkdir()  # a checkpoint dataset: the checkpoint's files, flat (subfolders' files renamed)
    for f, name in checkpoint_files(ckpt):
        shutil.copyfile(f, ckpt_data / name)
    second = build_kernel("train", tmp_path / "b2", user="alice", slug="demo-train", settings=TRAIN_SETTINGS,
                          kernel_type="notebook", dataset_sources=["alice/run-ckpt"],
                          checkpoint_dataset={"dataset": "alice/run-ckpt", "resume_setting": "resume_from"})
    root2 = session_root(tmp_path / "s2", {"demo-data": demo_data, "run-ckpt": ckpt_data})
    proc = run_built(second, root2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from alice/run-ckpt (step 3)" in proc.stdout and "resuming at step 3" in proc.stdout
    assert_identical_runs(straight_run, root2 / "working" / "train", 6)


@pytest.mark.slow
def test_built_tokenize_kernel_matches_kernels_tokenize(tmp_path, gpt2_ranks):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i % 7 + 1) for i in range(300)]
    (corpus / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    shutil.copyfile(gpt2_ranks, corpus / "gpt2.tiktoken")
    common = {"tokens_per_part": 6000, "shard_size": 2000, "prefix": "t", "processes": 1, "progress": False}
    direct = tmp_path / "direct"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in common.items() if k != "progress"]
    proc = run_script("kernels/tokenize.py", f"--data-files={corpus}/*.jsonl", f"--ranks-path={corpus}/gpt2.tiktoken",
                      f"--out-dir={direct}", "--no-progress", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    built = build_kernel("tokenize", tmp_path / "b", user="alice", slug="demo-tokens-part-0", settings={
        **common, "data_files": "{input:alice/demo-corpus}/*.jsonl",
        "ranks_path": "{input:alice/demo-corpus}/gpt2.tiktoken", "out_dir": "{working}"})
    root = session_root(tmp_path / "s", {"demo-corpus": corpus})
    proc = run_built(built, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = json.loads((direct / "manifest.json").read_text()), json.loads((root / "working/manifest.json").read_text())
    assert [(s["name"], s["sha256"]) for s in a["shards"]] == [(s["name"], s["sha256"]) for s in b["shards"]]
    assert len(a["shards"]) == 3
    for s in a["shards"]:
        assert (direct / s["name"]).read_bytes() == (root / "working" / s["name"]).read_bytes()


# --- bad input ------------------------------------------------------------------------------------------------

def test_unknown_accelerator_in_a_template_is_one_line(tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(REPO / "kernel-metadata", templates)
    meta = json.loads((templates / "train.json").read_text())
    meta["machine_shape"] = "TpuV99"
    (templates / "train.json").write_text(json.dumps(meta))
    proc = run_script("scripts/build_kernels.py", "train", "--user", "alice", "--out", str(tmp_path / "out"),
                      "--templates", str(templates))
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        f"error: {templates / 'train.json'}: unknown machine_shape 'TpuV99'; valid: TpuV38, Tpu1VmV38, TpuV5E8, "
        "TpuV6E8, NvidiaTeslaT4, NvidiaTeslaT4Highmem, NvidiaTeslaP100, NvidiaTeslaA100, NvidiaL4, NvidiaL4X1, "
        "NvidiaH100, NvidiaRtxPro6000 (or \"\" for CPU)"]
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="unknown machine_shape 'Gpu'"):
        fill_metadata(REPO / "kernel-metadata/eval.json", user="a", slug="abcd", title="abcd", code_file="x.py",
                      kernel_type="script", accelerator="Gpu")


def test_unknown_setting_and_bad_slug_are_refused(tmp_path):
    with pytest.raises(UserError, match="unknown train setting.*micro_batches"):
        build_kernel("train", tmp_path / "x", user="alice", slug="demo-train", settings={"micro_batches": 4})
    with pytest.raises(UserError, match="is not owner/slug"):
        build_kernel("train", tmp_path / "y", user="alice", slug="Bad Slug")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_train_kernel_without_its_publish_line_is_not_built(tmp_path):
    """Built without `BAKED_PUBLISH`, a train kernel would never publish its checkpoints: refused at build time."""
    from scripts.chain.build import render_kernel

    (tmp_path / "kernels").mkdir()
    source = (REPO / "kernels" / "train.py").read_text()
    (tmp_path / "kernels" / "train.py").write_text(source.replace("BAKED_PUBLISH = None", "PUBLISH = None"))
    with pytest.raises(UserError) as err:
        render_kernel("train", {"build_id": "x"}, repo=tmp_path)
    assert str(err.value) == "kernels/train.py: expected one `BAKED_PUBLISH = None` line"


def test_built_kernel_outside_a_session_says_so(tmp_path):
    built = build_kernel("train", tmp_path / "b", user="alice", slug="demo-train", settings=TRAIN_SETTINGS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KAGGLE_", "LOCAL_KAGGLE_"))}
    if Path("/kaggle/input").is_dir():
        pytest.skip("running on Kaggle")
    proc = subprocess.run([sys.executable, str(built / "demo-train.py")], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == ["error: this built kernel expects Kaggle's folders: run it on Kaggle or in "
                                        "the local Kaggle"]


def test_train_kernel_built_for_a_tpu_stops_when_the_session_has_none(demo_data, tmp_path):
    # Kaggle ran the session without a TPU: one line, exit 2, before the checkpoint dataset is staged or any
    # output is written (no silent 9 hours on a CPU).
    ckpt_data = tmp_path / "ckpt-data"
    ckpt_data.mkdir()
    built = build_kernel("train", tmp_path / "b", user="alice", slug="demo-train", settings=TRAIN_SETTINGS,
                         accelerator="TpuV5E8", dataset_sources=["alice/run-ckpt"],
                         checkpoint_dataset={"dataset": "alice/run-ckpt", "resume_setting": "resume_from",
                                             "publish": True, "expect_step": 3})
    root = session_root(tmp_path / "s", {"demo-data": demo_data, "run-ckpt": ckpt_data})
    proc = run_built(built, root, session_machine="")
    assert proc.returncode == 2
    assert error_lines(proc.stderr) == [
        "error: this train kernel was built for a TPU (TpuV5E8) but this session has none (the local Kaggle "
        "session's machine is CPU); stopping before any work. Check the notebook's accelerator setting and TPU quota"]
    assert not (root / "temp" / "gpt2k-resume").exists() and not any((root / "working").iterdir())
    # The same build on a TPU session (the local Kaggle's stand-in) goes past the check to the dataset step.
    proc = run_built(built, root, session_machine="TpuV5E8")
    assert proc.returncode == 2 and "holds step 3" in "".join(error_lines(proc.stderr))
