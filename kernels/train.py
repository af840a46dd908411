"""Train kernel: one bounded training session that resumes from the newest checkpoint and ends with one.

Locally:  python kernels/train.py --preset tiny --data-dir data/demo --out-dir runs/demo --max-steps 50
On Kaggle the build bakes these settings in, so the kernel runs with no arguments.
"""

import os
import sys

# The import path, the same in every kernel (why: scripts/chain/build.py).
_KERNELS_DIR = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _KERNELS_DIR]
sys.path.insert(0, os.path.dirname(_KERNELS_DIR))

from shared.config import TrainConfig, parse_dataclass  # noqa: E402
from shared.errors import run_cli  # noqa: E402

BAKED_SETTINGS: dict = {}  # filled in by scripts/build_kernels.py for Kaggle


def main() -> None:
    cfg = parse_dataclass(TrainConfig, description=__doc__, defaults=BAKED_SETTINGS)
    from shared.kaggle.publish import after_training
    from shared.train.trainer import train

    result = train(cfg)
    after_training(result)  # a Kaggle build with a checkpoint dataset publishes the final checkpoint to it


if __name__ == "__main__":
    run_cli(main)
