"""Building the kernels and chaining Kaggle sessions through them; runs on the user's machine, never in a kernel.

From one config (`config`), `Chain` (`chain`) pushes the missing tokenize parts, then train sessions one after
another that resume from and publish to a checkpoint dataset, then the eval kernel (`tokenize_stage`,
`train_stage`, `eval_stage`). Every push is recorded in a JSON state file (`state`) before and after it happens,
with a push id written into the pushed code (`context`), so a chain killed at any point and started again
continues without pushing a session twice. Each kernel is built into one self-contained file (`build`); the
Kaggle API is reached through a small retrying client (`client`).

Module-level imports are the standard library and `shared`'s light modules only (the chain never needs torch).
"""

from scripts.chain.build import KERNEL_NAMES, REPO, build_kernel, fill_metadata
from scripts.chain.chain import Chain
from scripts.chain.client import ApiFailure, KaggleClient
from scripts.chain.config import ChainConfig, ClientConfig, config_from_dict, load_config
from scripts.chain.limits import MACHINE_SHAPES

__all__ = ["KERNEL_NAMES", "MACHINE_SHAPES", "REPO", "ApiFailure", "Chain", "ChainConfig", "ClientConfig",
           "KaggleClient", "build_kernel", "config_from_dict", "fill_metadata", "load_config"]
