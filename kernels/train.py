"""Train kernel: one bounded training session that resumes from the newest checkpoint and ends with one.

Locally:  python kernels/train.py --preset tiny --data-dir data/demo --out-dir runs/demo --total-steps 50
On Kaggle the build bakes these settings in, so the kernel runs with no arguments.
"""

import os
import sys

# The import path, the same in every kernel (why: scripts/chain/build.py).
_KERNELS_DIR = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _KERNELS_DIR]
sys.path.insert(0, os.path.dirname(_KERNELS_DIR))

from shared.config import TrainConfig  # noqa: E402
from shared.errors import run_cli  # noqa: E402
from shared.flags import parse_dataclass  # noqa: E402

BAKED_SETTINGS: dict = {}  # filled in by the build (scripts/chain/build.py) for Kaggle
BAKED_PUBLISH = None  # a build with a checkpoint dataset: what to publish after training (a PublishPlan)


def main() -> None:
    from shared.session_clock import process_start

    started = process_start()  # --session-deadline counts from here: the bootstrap's installs and fetch included
    cfg = parse_dataclass(TrainConfig, description=__doc__, defaults=BAKED_SETTINGS)
    from shared.kaggle.env import kaggle_paths
    from shared.kaggle.packages import installed_seconds
    from shared.kaggle.publish import MidwayPublish, after_training
    from shared.kaggle.secrets import wandb_key
    from shared.train.trainer import train

    installs = installed_seconds()
    # A build whose sessions are long publishes one checkpoint midway through too (PublishPlan.midway_s).
    midway = (MidwayPublish(BAKED_PUBLISH, started, kaggle_paths().temp / "gpt2k-midway")
              if getattr(BAKED_PUBLISH, "midway_s", 0) else None)
    result = train(cfg, wandb_key=wandb_key() if cfg.logging.wandb_project else None, started=started,
                   startup_parts={"packages": installs} if installs else None, on_checkpoint=midway)
    # The session is killed publish_s after its deadline (the chain's publish margin): the publish gives up before.
    publish_s = getattr(BAKED_PUBLISH, "publish_s", 0)
    end = started + cfg.session.session_deadline + publish_s if cfg.session.session_deadline and publish_s else None
    after_training(result, BAKED_PUBLISH, session_end=end, midway=midway)  # the final checkpoint, where built so


if __name__ == "__main__":
    run_cli(main)
