"""Fixtures of the training tests: the XLA runtime, started once for the folder.

torch's autograd engine sizes its per-device queues at the first backward pass; a backend whose devices appear
after that (torch_xla's) then fails its first backward. These tests mix CPU and XLA runs in one process, so the
XLA runtime (SPMD over the 8 CPU devices) starts before any of them runs."""

from shared.train.device import make_runtime

make_runtime("xla")
