"""See the TPU from a laptop: compile the train step a session will run with Kaggle's TPU compiler (libtpu's
compile-only client, no TPU needed) and print, per TPU, what the compiler says: HBM per chip (and whether it fits),
the step's FLOPs and HBM bytes, its collectives inside and outside the accumulation loop, and a roofline lower bound
on its time with the MFU ceiling it implies. Every figure is the compiler's or an estimate from its output; none is
a measurement.

    python scripts/tpu_compile.py --config examples/chain-gpt2-124m.json          # its train section, v5e-8
    python scripts/tpu_compile.py --preset gpt2 --micro-batch 64 --tpu all
    python scripts/tpu_compile.py --preset gpt2-large --fsdp --tpu v6e-8
    python scripts/tpu_compile.py --preset gpt2-xl --fsdp --tpu all --trace-only DIR   # compiled on a larger machine
    python scripts/tpu_compile.py --tpu all --analyse DIR                               # then read back here
    python scripts/tpu_compile.py --preset gpt2 --tpu-python VENV/bin/python   # and with VENV's libtpu: what differs

The step is traced with torch_xla on 8 CPU devices, never run (its state is placeholders), and compiled in the
TPU compiler's virtualenv (.venv-tpu, made by scripts/setup.sh: jax and libtpu as Kaggle's TPU image pins them).
Attention is the kernel a session on that TPU tries first at the step's sequence length for the train setting
`attention` (`--attention`; default: the config's, else auto; shared/model/attention.py decides for both): jax's
splash attention where its blocks tile the sequence, else torch_xla's Pallas flash kernel where its do, else SDPA
(gpt2-demo's 32 tokens), a Pallas kernel lowered by jax for the TPU platform here, without a TPU
(shared/runtime/step_trace.py); `micro_batch: auto` is resolved as a session whose probe of that kernel passes
resolves it. `--attention flash` compiles the step a session falls back to where its splash probe fails,
`--attention sdpa` the step where every probe fails; a kernel a session would not try at that length is not
compiled, the one it would try instead is (the report's `attention` names it). `--plan` compiles the first, then
each fallback. Results are cached by settings and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.tpu_compile_report import check_tpu_python, compare_lines  # noqa: E402
from scripts.tpu_compile_step import KAGGLE_TPUS, TPUS, analyse, compile_step, report_lines  # noqa: E402
from shared.errors import UserError, run_cli  # noqa: E402
from shared.train_sections import ATTENTION_SETTINGS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a chain config (its train section)")
    parser.add_argument("--preset", help="a model preset (without --config)")
    parser.add_argument("--micro-batch", help="sequences per micro-step over all chips, or auto (the default)")
    parser.add_argument("--total-batch-tokens", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--activation-checkpointing", choices=("on", "off", "auto"))
    parser.add_argument("--attention", choices=ATTENTION_SETTINGS,
                        help="the train setting attention (default: the config's, else auto): auto, the kernel a "
                        "session tries first at this sequence length (splash, else flash, else SDPA, where their "
                        "blocks tile it); flash: the step where the splash probe fails; sdpa: where every probe "
                        "fails; splash: the splash step where it tiles the length")
    parser.add_argument("--tpu", default="v5e-8", choices=(*TPUS, "all"), help="all: Kaggle's, v5e-8 and v6e-8")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")
    parser.add_argument("--tpu-python", type=Path, metavar="PYTHON", help="compile the step a second time with "
                        "this interpreter's jax and libtpu (another virtualenv's python with jax[tpu]) and say how "
                        "its collectives inside the loop differ (KEEP/tpu-python/<tpu>/ with --keep; JSON: "
                        "each report's `tpu_python`)")
    parser.add_argument("--keep", type=Path, help="compile afresh and keep each TPU's trace and optimized HLO in "
                        "KEEP/<tpu>/ (optimized.hlo.txt: read with scripts/hlo_cost.py)")
    parser.add_argument("--trace-only", type=Path, metavar="DIR", help="trace each TPU's step into DIR/<tpu>/ and "
                        "stop: compile it where memory allows (scripts/tpu_compile_libtpu.py DIR/<tpu> TOPOLOGY "
                        "BOUNDS, as printed), then read it with --analyse DIR")
    parser.add_argument("--analyse", type=Path, metavar="DIR", help="report on steps traced with --trace-only and "
                        "compiled elsewhere (DIR/<tpu>/ with the compiler's files beside the trace)")
    args = parser.parse_args()
    check_tpu_python(args)
    if args.analyse:
        tpus = KAGGLE_TPUS if args.tpu == "all" else [args.tpu]
        reports = [analyse(args.analyse / tpu, tpu) for tpu in tpus if (args.analyse / tpu / "compiled.json").exists()]
        if not reports:
            raise UserError(f"no compiled step under {args.analyse}/<tpu>/ for {', '.join(tpus)}")
        print(json.dumps(reports, indent=1) if args.json else "\n\n".join("\n".join(report_lines(r))
                                                                             for r in reports))
        return
    if bool(args.config) == bool(args.preset):
        raise UserError("give --config CONFIG.json or --preset NAME")
    if args.config:  # the settings a session of that chain trains with, as --plan compiles them
        from scripts.chain.config import load_config

        chain = load_config(args.config)
        settings = chain.train_settings
    else:  # as the example chains set it: auto, resolved as a session on that TPU resolves it
        settings = {"preset": args.preset, "micro_batch": "auto"}
    for name in ("micro_batch", "total_batch_tokens", "seq_len", "activation_checkpointing", "attention"):
        value = getattr(args, name)
        if value is not None:
            settings[name] = int(value) if name == "micro_batch" and value != "auto" else value
    if args.fsdp:
        settings["fsdp"] = True
    reports = []
    for tpu in (KAGGLE_TPUS if args.tpu == "all" else [args.tpu]):
        started = time.monotonic()
        report = compile_step(settings, tpu, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                              keep=args.keep, trace_only=args.trace_only)
        if not report:
            continue
        reports.append(report)
        if args.tpu_python:
            report["tpu_python"] = compile_step(
                settings, tpu, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                keep=args.keep / "tpu-python" if args.keep else None, python=args.tpu_python)
        if not args.json:
            print("\n".join(report_lines(report)))
            if args.tpu_python:
                print("\n".join(["", *report_lines(report["tpu_python"]), "",
                                 *compare_lines(report, report["tpu_python"])]))
            print(f"({time.monotonic() - started:.0f} s)\n", flush=True)
    if args.json:
        print(json.dumps(reports, indent=1))


if __name__ == "__main__":
    run_cli(main)
