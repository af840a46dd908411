"""Stage 2, train: `model` (GPT-2), `optim` (AdamW or Muon, LR schedules), `device` (XLA SPMD / DDP / torch
runtimes) with `tpu` (TPU generation detection), `checkpoint` (preemption-safe, resumable), `metrics` (JSONL,
W&B, plots) and `trainer`, the loop that ties them together for one bounded session."""
