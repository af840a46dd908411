"""Stage 2, train: the loop of one bounded session. `trainer` (`train()`, top to bottom), `session` (the resume
point, step log, evaluator, profiler), `checkpoint` and `checkpoint_writer` (preemption-safe, resumable),
`metrics` (JSONL, W&B, plots), `validation` with `hellaswag`, `sampling` and `health` (the evals inside training,
which the eval kernel reuses), and the run's outlook: `throughput`, `projection` and `reference` (against a
published run). It drives the model (shared/model/) through the runtime (shared/runtime/: devices, XLA, the
step) and sits above both."""
