"""XLA graph hygiene benchmark: a 100-step tiny run (warm-up and cosine LR changes, periodic evals, a
checkpoint) on all XLA devices; prints compilations after step 2 (goal 0) and transfers per step.

    python scripts/bench_graph.py            # PJRT_DEVICE=CPU CPU_NUM_DEVICES=8 are the default off-TPU
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.errors import run_cli  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--data-dir", default="", help="token shards (default: build the demo corpus)")
    parser.add_argument("--accum", type=int, default=2, help="micro-steps per optimizer step (default 2)")
    parser.add_argument("--per-micro-step", action="store_true",
                        help="the earlier step structure (--no-grad-accum-loop: a graph per micro-step), to compare")
    args = parser.parse_args()

    from shared.config import TrainConfig
    from shared.tokenize.demo_corpus import build_demo_corpus
    from shared.train.device import make_runtime
    from shared.train.metrics import read_metrics
    from shared.train.trainer import train

    with tempfile.TemporaryDirectory() as tmp:
        data_dir = args.data_dir or build_demo_corpus(f"{tmp}/data", max_chars=600_000) and f"{tmp}/data"
        cfg = TrainConfig(preset="tiny", data_dir=data_dir, out_dir=f"{tmp}/run", seq_len=32, micro_batch=8,
                          total_batch_tokens=256 * args.accum, max_steps=args.steps, warmup_steps=10, log_every=1,
                          eval_every=25, eval_batches=2, checkpoint_every=args.steps // 2, progress=False,
                          wandb_project="", grad_accum_loop=not args.per_micro_step)
        start = time.perf_counter()
        result = train(cfg, make_runtime("xla"), log=lambda msg: print(msg, flush=True))
        wall = time.perf_counter() - start
        records = read_metrics(f"{tmp}/run/metrics.jsonl")
    steps = {r["step"]: r for r in records if "loss" in r}
    evals = [r["step"] for r in records if "val_loss" in r]
    ckpts = [r["step"] for r in records if r.get("event") == "checkpoint"]
    last = max(steps)
    # Transfers per plain step: steps whose window holds no eval or checkpoint.
    plain = [s for s in range(3, last + 1) if s - 1 not in evals and s - 1 not in ckpts and s - 1 in steps]
    graphs = [steps[s]["graphs"] - steps[s - 1]["graphs"] for s in plain]
    h2d = [steps[s]["h2d_transfers"] - steps[s - 1]["h2d_transfers"] for s in plain]
    d2h = [steps[s]["d2h_transfers"] - steps[s - 1]["d2h_transfers"] for s in plain]
    lrs = {round(steps[s]["lr"], 10) for s in steps}
    print(f"\nsteps run: {result.step}  wall: {wall:.1f}s  distinct LRs: {len(lrs)}  evals after steps: {evals}  "
          f"checkpoints after steps: {ckpts}")
    print(f"XLA compilations: {steps[2]['compiles']} by step 2, {steps[last]['compiles']} by step {last}; "
          f"after step 2: {steps[last]['compiles'] - steps[2]['compiles']} (goal 0)")
    print(f"per plain step ({len(plain)} steps, grad accumulation {cfg.grad_accum_steps}): graphs executed "
          f"{min(graphs)}-{max(graphs)}, host-to-device "
          f"{min(h2d)}-{max(h2d)} (token batches), device-to-host {min(d2h)}-{max(d2h)} "
          f"(logged loss, lr, grad norm; logging every step here)")


if __name__ == "__main__":
    run_cli(main)
