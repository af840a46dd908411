#!/usr/bin/env bash
# A short real training run: the tiny preset on Python's own documentation (built offline), on all 8
# torch_xla CPU devices (the TPU code path). Prints the loss; writes checkpoints, metrics and a loss plot.
set -euo pipefail
cd "$(dirname "$0")/.."
export PJRT_DEVICE=${PJRT_DEVICE:-CPU} CPU_NUM_DEVICES=${CPU_NUM_DEVICES:-8} TF_CPP_MIN_LOG_LEVEL=2
[ -f data/demo/demo_val_000000.bin ] || .venv/bin/python scripts/build_demo_corpus.py data/demo
.venv/bin/python kernels/train.py --preset tiny --data-dir data/demo --out-dir runs/demo \
  --seq-len 128 --micro-batch 16 --total-batch-tokens 2048 --total-steps 60 --warmup-steps 6 --lr 3e-3 \
  --eval-every 20 --eval-batches 4 --checkpoint-every 30 --log-every 5 --wandb-project "" "$@"
echo "results: runs/demo/metrics.jsonl, runs/demo/loss.png, runs/demo/checkpoints/"
