"""One trainer on every backend: DDP (torchrun, gloo, 2 processes) equals one process with the same total
batch, and a checkpoint written on one backend resumes on another (TPU/XLA <-> GPU/CPU)."""

import os
import subprocess
import sys

import pytest
import torch
from helpers import REPO, train_config
from safetensors.torch import load_file

from shared.config import TrainConfig
from shared.runtime.device import make_runtime
from shared.train.checkpoint import list_checkpoints
from shared.train.metrics import read_metrics
from shared.train.trainer import train

FLAGS = ["--seq-len", "32", "--micro-batch", "8", "--total-batch-tokens", "512", "--total-steps", "4",
         "--warmup-steps", "2", "--log-every", "1", "--eval-every", "2", "--eval-batches", "2", "--no-progress",
         "--wandb-project", "", "--no-bf16", "--backend", "cpu"]


def _final_model(out_dir):
    return load_file(list_checkpoints(out_dir / "checkpoints")[-1] / "model.safetensors")


def _records(out_dir, key):
    return [(r["step"], r[key]) for r in read_metrics(out_dir / "metrics.jsonl") if key in r]


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(demo_data, tmp_path):
    common = [str(REPO / "kernels/train.py"), "--data-dir", str(demo_data), *FLAGS]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    single = subprocess.run([sys.executable, *common, "--out-dir", str(tmp_path / "one")], capture_output=True,
                            text=True, env=env, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          *common, "--out-dir", str(tmp_path / "ddp")], capture_output=True, text=True, env=env,
                         timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    assert "ddp:cpu x2" in ddp.stdout and ddp.stdout.count("session ended") == 1  # one process speaks
    one, two = _final_model(tmp_path / "one"), _final_model(tmp_path / "ddp")
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    for key in ("loss", "val_loss", "grad_norm"):
        a, b = _records(tmp_path / "one", key), _records(tmp_path / "ddp", key)
        assert [s for s, _ in a] == [s for s, _ in b] and len(a) >= 3
        assert all(abs(x - y) < 1e-4 for (_, x), (_, y) in zip(a, b, strict=True))


def _cfg(demo_data, out_dir, **kw) -> TrainConfig:
    return train_config(preset="tiny", data_dir=str(demo_data), out_dir=str(out_dir), seq_len=32, micro_batch=8,
                        total_batch_tokens=512, warmup_steps=2, log_every=1, eval_every=0, progress=False,
                        wandb_project="", bf16=False, checkpoint_every=0, **kw)


@pytest.mark.slow
def test_checkpoints_move_between_xla_and_torch_backends(demo_data, tmp_path):
    quiet = dict(log=lambda *a: None)
    reference = train(_cfg(demo_data, tmp_path / "cpu", total_steps=4), make_runtime("cpu"), **quiet)
    # TPU path (XLA SPMD) for two steps, then resumed on the torch CPU path, and the other way round.
    train(_cfg(demo_data, tmp_path / "x2c", total_steps=4, stop_after_steps=2), make_runtime("xla"), **quiet)
    x2c = train(_cfg(demo_data, tmp_path / "x2c", total_steps=4), make_runtime("cpu"), **quiet)
    train(_cfg(demo_data, tmp_path / "c2x", total_steps=4, stop_after_steps=2), make_runtime("cpu"), **quiet)
    c2x = train(_cfg(demo_data, tmp_path / "c2x", total_steps=4), make_runtime("xla"), **quiet)
    assert reference.step == x2c.step == c2x.step == 4
    ref = _final_model(tmp_path / "cpu")
    for run in ("x2c", "c2x"):
        got = _final_model(tmp_path / run)
        assert max((ref[k] - got[k]).abs().max().item() for k in ref) < 1e-4, run
        losses = [loss for _, loss in _records(tmp_path / run, "loss")]
        ref_losses = [loss for _, loss in _records(tmp_path / "cpu", "loss")]
        assert len(losses) == 4 and all(abs(a - b) < 1e-3 for a, b in zip(losses, ref_losses, strict=True))
    assert torch.isfinite(ref["transformer.wte.weight"]).all()
