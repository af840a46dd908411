#!/usr/bin/env python3
"""Build self-contained Kaggle kernels: build/kernels/<tokenize|train|eval>/ with one code file (the `shared`
package embedded in it, settings baked in) and kernel-metadata.json from kernel-metadata/<name>.json.

    python scripts/build_kernels.py --user alice                         # all three, script form
    python scripts/build_kernels.py train --user alice --notebook \\
        --set preset=gpt2 --set data_dir={input:alice/fineweb-tokens-part-0} --dataset alice/gpt2-checkpoints
    kaggle kernels push -p build/kernels/train

Settings (--set KEY=VALUE, values parsed as JSON when they parse) may name an attached input as
`{input:owner/slug}`, and `{working}` / `{temp}` for the session's folders; the kernel resolves them when it
starts. Normally scripts/chain_sessions.py builds and pushes these for you.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.chain.build import KERNEL_NAMES, REPO, build_kernel  # noqa: E402
from shared.errors import UserError, run_cli  # noqa: E402


def parse_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", default=[], metavar="KERNEL",
                        help=f"which kernels: {', '.join(KERNEL_NAMES)} (default: all three)")
    parser.add_argument("--user", required=True, help="Kaggle user owning the kernels")
    parser.add_argument("--name", default="gpt2", help="slug prefix: <name>-tokens, <name>-train, <name>-eval")
    parser.add_argument("--slug", help="the kernel's slug (one kernel only)")
    parser.add_argument("--out", default=str(REPO / "build" / "kernels"), help="output root")
    parser.add_argument("--notebook", action="store_true", help="an .ipynb (Save & Run All in the UI), not a script")
    parser.add_argument("--accelerator", help="machine_shape (TpuV5E8, TpuV6E8, NvidiaTeslaT4, ...; '' for CPU)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a baked setting")
    parser.add_argument("--dataset", action="append", default=[], help="a dataset source owner/slug")
    parser.add_argument("--kernel-source", action="append", default=[], help="a kernel source owner/slug")
    parser.add_argument("--checkpoint-dataset", default="",
                        help="train: resume from and publish to this dataset (owner/slug)")
    parser.add_argument("--templates", default=str(REPO / "kernel-metadata"), help="metadata template folder")
    args = parser.parse_args(argv)
    names = args.kernels or list(KERNEL_NAMES)
    unknown = [n for n in names if n not in KERNEL_NAMES]
    if unknown:
        raise UserError(f"unknown kernel {unknown[0]!r}; choose from {', '.join(KERNEL_NAMES)}")
    if args.slug and len(names) != 1:
        raise UserError("--slug names one kernel; give exactly one kernel name")
    settings = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise UserError(f"--set {item!r}: expected KEY=VALUE")
        settings[key.replace("-", "_")] = parse_value(value)
    built = []
    for name in names:
        slug = args.slug or {"tokenize": f"{args.name}-tokens", "train": f"{args.name}-train",
                             "eval": f"{args.name}-eval"}[name]
        ckpt = None
        sources = list(args.dataset)
        if name == "train" and args.checkpoint_dataset:
            ckpt = {"dataset": args.checkpoint_dataset, "resume_setting": "resume_from", "publish": True}
            sources.insert(0, args.checkpoint_dataset)
        out = build_kernel(name, Path(args.out) / name, user=args.user, slug=slug,
                           settings=settings if len(names) == 1 else {}, accelerator=args.accelerator,
                           kernel_type="notebook" if args.notebook else "script", dataset_sources=sources,
                           kernel_sources=args.kernel_source, checkpoint_dataset=ckpt, template_dir=args.templates)
        code = json.loads((out / "kernel-metadata.json").read_text())["code_file"]
        print(f"built {out / code} ({(out / code).stat().st_size / 1e3:.0f} kB) and {out / 'kernel-metadata.json'}")
        built.append(out)
    return built


if __name__ == "__main__":
    run_cli(main)
