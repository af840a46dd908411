"""The runtime: the model on the devices, and the step. `device` picks the runtime for the backend; `runtime`
(plain torch, DDP) and `xla_runtime` (torch_xla SPMD, with `accum_loop` and `xla_notices`) hold the model on the
devices; `attention_select`, `attention_probe` and `mosaic_version` make, prove and pin a Pallas attention kernel
on the session's mesh; `step` builds the one optimizer step with `optim` (AdamW or Muon, the LR schedules), and
`step_trace` traces that step for a TPU's compiler without running it. It imports the model (shared/model/) and
the common modules, never the training loop (shared/train/) that drives it."""
