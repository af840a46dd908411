"""The train kernel on the torch/torch_xla that Kaggle's TPU image ships (2.8.0; docs/kaggle-tpu.md), on the
CPU backend: it trains with the same step structure and the same losses as on the project's pinned 2.9.0.

The interpreter is `.venv-kaggle-tpu`, made by `bash scripts/setup.sh --kaggle-image` (CI does)."""

import os
import subprocess

import pytest
from helpers import REPO, SMALL_ARGS, loss_history, small_config, train_in_process

from shared.train.metrics import read_metrics

KAGGLE_PYTHON = REPO / ".venv-kaggle-tpu" / "bin" / "python"
KAGGLE_TORCH = "2.8.0"


@pytest.mark.slow
def test_train_kernel_runs_on_kaggles_tpu_image_versions(demo_data, tmp_path):
    if not KAGGLE_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{KAGGLE_PYTHON} is missing: CI must run `bash scripts/setup.sh --kaggle-image`")
        pytest.skip("no .venv-kaggle-tpu: run `bash scripts/setup.sh --kaggle-image`")
    out = tmp_path / "kaggle-image"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([str(KAGGLE_PYTHON), str(REPO / "kernels/train.py"), "--data-dir", str(demo_data),
                           "--out-dir", str(out), *SMALL_ARGS, "--total-steps", "4", "--total-batch-tokens", "1024"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The kernel says what it runs on, and runs the one-graph step there too.
    assert f"torch {KAGGLE_TORCH}" in proc.stdout and f"torch_xla {KAGGLE_TORCH}" in proc.stdout
    assert "one graph per step (micro-steps in an XLA loop)" in proc.stdout
    records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
    assert records[4]["compiles"] == records[2]["compiles"]
    assert records[4]["graphs"] - records[3]["graphs"] == 1
    start = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "session_start")
    assert start["versions"]["torch_xla"] == KAGGLE_TORCH
    # The same run on the project's torch_xla 2.9.0 (this process) trains the same model.
    pinned = tmp_path / "pinned"
    train_in_process(small_config(demo_data, pinned, total_steps=4, total_batch_tokens=1024))
    ours, theirs = loss_history(pinned), loss_history(out)
    assert [h[0] for h in ours] == [h[0] for h in theirs] == [1, 2, 3, 4]
    for (_, loss, lr, grad_norm), (_, loss_k, lr_k, grad_norm_k) in zip(ours, theirs, strict=True):
        assert lr == lr_k and abs(loss - loss_k) < 1e-3 and abs(grad_norm - grad_norm_k) < 1e-2 * grad_norm
