"""A checkpoint's names, with only the standard library: the session bootstrap, the publisher and the chain use
them without importing torch (the layout itself is described in shared/train/checkpoint.py)."""

from __future__ import annotations

MODEL_FILE, OPTIMIZER_FILE, STATE_FILE, METRICS_FILE, MANIFEST_FILE = (
    "model.safetensors", "optimizer.safetensors", "state.json", "metrics.jsonl", "checkpoint.json")
CHECKPOINT_PREFIX = "step_"
# Inside a checkpoints root: a wsd run's checkpoint where its stable phase ends, out of rotation (--extend trains on
# from it; a checkpoint dataset carries it beside the newest, its files named `stable__<file>`).
STABLE_DIR = "stable"


def checkpoint_name(step: int) -> str:
    """The folder of the checkpoint at `step`: step_NNNNNN."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"
