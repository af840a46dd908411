"""Export a training checkpoint as a Hugging Face GPT-2 folder.

    python scripts/export_hf.py runs/demo out/hf      # newest checkpoint of a run
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('out/hf')"
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.errors import run_cli  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint_dir", help="a checkpoint (step_NNNNNN), its checkpoints/ root, or a run dir")
    parser.add_argument("out_dir")
    parser.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer files")
    args = parser.parse_args()
    from shared.eval.hf import export_hf, model_from_checkpoint

    model = model_from_checkpoint(args.checkpoint_dir)
    out = export_hf(model, args.out_dir, tokenizer=not args.no_tokenizer)
    print(f"wrote {out}: config, model.safetensors ({model.num_params() / 1e6:.2f}M parameters)"
          f"{'' if args.no_tokenizer else ', tokenizer files'}")


if __name__ == "__main__":
    run_cli(main)
