"""Checkpoint save/load time for a preset (default gpt2, 124M) with its AdamW state, on this machine, and
the time-budget margin the trainer derives from it.

    python scripts/bench_checkpoint.py [--preset gpt2] [--dir /tmp/ckpt-bench]
"""

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.errors import run_cli  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--dir", default="", help="where to write (default: a temporary directory)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import torch

    from shared.config import NINE_HOURS, TrainConfig
    from shared.model.model import GPT
    from shared.runtime.optim import make_optimizer, optimizer_tensors
    from shared.runtime.runtime import Runtime
    from shared.session_clock import default_time_budget, estimate_checkpoint_seconds
    from shared.train.checkpoint import latest_checkpoint, save_checkpoint

    cfg = TrainConfig.from_dict(dict(preset=args.preset))
    model = GPT(cfg.model.shape)
    named = list(model.named_parameters())
    opt = make_optimizer(named, cfg.optim, Runtime("cpu"), torch.tensor(cfg.optim.lr))
    model_tensors = model.checkpoint_tensors()
    opt_tensors = optimizer_tensors(opt, named)
    nbytes = sum(t.numel() * t.element_size() for t in [*model_tensors.values(), *opt_tensors.values()])
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    saves, loads = [], []
    try:
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            save_checkpoint(root, step, model_tensors, opt_tensors, {"config": {}}, keep=1)
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            loaded = latest_checkpoint(root)
            loads.append(time.perf_counter() - start)
            assert loaded.step == step
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    save_s, load_s = max(saves), max(loads)  # the margin must cover the slow case
    print(f"{args.preset}: {model.num_params() / 1e6:.1f}M parameters, checkpoint {nbytes / 1e9:.2f} GB "
          f"(fp32 weights + AdamW moments)")
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)
    print(f"save (write, fsync, sha256, rename): worst {save_s:.2f} s of {args.repeats} ({fmt(saves)})")
    print(f"load (sha256 verify + read):          worst {load_s:.2f} s of {args.repeats} ({fmt(loads)})")
    print(f"before any timing the trainer assumes {estimate_checkpoint_seconds(model.num_params()):.1f} s")
    budget = default_time_budget(save_s)
    print(f"default time budget with this checkpoint time: {budget:.0f} s = 9 h less {NINE_HOURS - budget:.0f} s "
          f"(the loop also stops one step + {1.5 * save_s:.1f} s before it)")


if __name__ == "__main__":
    run_cli(main)
