"""Kaggle kernel: tokenize one part of a corpus into llm.c shards (logic in shared/tokenize/part.py).

    python kernels/tokenize.py --out-dir /kaggle/working                      # part 0 of FineWeb-Edu 10BT
    python kernels/tokenize.py --part 1 --prev-dir /kaggle/input/part0 --out-dir /kaggle/working
    python kernels/tokenize.py --data-files 'corpus/*.parquet' --out-dir data/mine   # local files, offline

Run again with the same flags after a kill: finished shards are verified and kept.
"""

import os
import sys

# The import path, the same in every kernel (why: scripts/chain/build.py).
_KERNELS_DIR = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != _KERNELS_DIR]
sys.path.insert(0, os.path.dirname(_KERNELS_DIR))

# `datasets` imports torch (seconds of start-up on the critical path) when it finds it; this kernel needs
# none of its framework integrations.
for _var in ("USE_TORCH", "USE_TF", "USE_JAX"):
    os.environ.setdefault(_var, "0")

from shared.config import TokenizeConfig  # noqa: E402
from shared.errors import run_cli  # noqa: E402
from shared.flags import parse_dataclass  # noqa: E402
from shared.kaggle.secrets import hf_token_to_env  # noqa: E402
from shared.tokenize.part import tokenize_part  # noqa: E402
from shared.tokenize.source import hub_endpoint  # noqa: E402

BAKED_SETTINGS: dict = {}  # filled in by the build (scripts/chain/build.py) for Kaggle


def print_summary(manifest: dict) -> None:
    s = manifest["summary"]
    gb = s["bytes"] / 1e9
    rate = f"{s['tokens_per_second'] / 1e6:.2f}M tokens/s" if s["new_tokens"] else "nothing new to do"
    print(f"part {s['part']}: {s['shards']} shards, {s['tokens']:,} tokens, {s['docs']:,} documents, "
          f"{gb:.3f} GB in {s['out_dir']}")
    print(f"stream: documents {s['start']['doc']}+{s['start']['offset']} -> {s['end']['doc']}+{s['end']['offset']} "
          f"(stopped: {s['stop_reason']})")
    # the whole time, pinning the revision and any wait on the Hub before the stream included (issue 50)
    print(f"this run: {s['new_tokens']:,} tokens in {s['total_seconds']:.1f}s, {s['seconds']:.1f}s of it streaming "
          f"({rate})" + (", resumed a previous run" if s["resumed"] else ""))


def main(argv: list[str] | None = None) -> dict:
    cfg = parse_dataclass(TokenizeConfig, argv, description=__doc__.splitlines()[0], defaults=BAKED_SETTINGS)
    if not cfg.data_files:
        print(f"{cfg.dataset}: read from {hub_endpoint()} "
              + ("with the HF_TOKEN secret" if hf_token_to_env() else
                 "anonymously (attach a Hugging Face token as the secret HF_TOKEN for per-account rate limits)"),
              flush=True)
    manifest = tokenize_part(cfg)
    print_summary(manifest)
    return manifest


if __name__ == "__main__":
    run_cli(main)
