"""Eval kernel: did the model reach GPT-2? Validation loss, HellaSwag, samples, a report with plots, and the
model as a Hugging Face folder (optionally a Kaggle Model version).

Locally:  python kernels/eval.py --checkpoint runs/demo --data-dir data/demo --hellaswag hs.jsonl --out-dir runs/eval
On Kaggle the build bakes these settings in (the checkpoint defaults to the newest under /kaggle/input).
"""

import os
import sys

# The import path, the same in every kernel (why: scripts/chain/build.py).
_KERNELS_DIR = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _KERNELS_DIR]
sys.path.insert(0, os.path.dirname(_KERNELS_DIR))

from shared.config import EvalConfig  # noqa: E402
from shared.errors import run_cli  # noqa: E402
from shared.flags import parse_dataclass  # noqa: E402

BAKED_SETTINGS: dict = {}  # filled in by the build (scripts/chain/build.py) for Kaggle


def main() -> None:
    cfg = parse_dataclass(EvalConfig, description=__doc__, defaults=BAKED_SETTINGS)
    from shared.eval.evaluate import run_eval

    if cfg.out_dir == "runs/eval":  # the default: on Kaggle, the session's saved output
        from shared.kaggle.env import in_session, kaggle_paths

        if in_session():
            cfg.out_dir = str(kaggle_paths().working)
    run_eval(cfg)


if __name__ == "__main__":
    run_cli(main)
