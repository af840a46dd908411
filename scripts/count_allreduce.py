"""Count the gradient all-reduces of the training step, inside and outside its accumulation loop, from XLA's own
dump of the compiled (SPMD-partitioned, optimized) step graph.

    python scripts/count_allreduce.py                       # tiny, accumulation 4, on 8 XLA CPU devices
    python scripts/count_allreduce.py --preset gpt2 --seq-len 128
    python scripts/count_allreduce.py --torch-xla-accum     # the same with torch_xla's gradient_accumulation
    python scripts/count_allreduce.py --hlo some_after_optimizations.txt   # count an existing dump

It trains 2 steps with XLA_FLAGS=--xla_dump_to (set before torch_xla starts), takes the largest optimized module
with a While loop (the step), and attributes each all-reduce to the loop (reachable from a While body: run once per
micro-step) or to the rest of the step (once per step), with the bytes each moves per run.
"""

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.hlo_cost import shape_bytes  # noqa: E402 - an HLO shape's bytes, as the TPU report counts them
from shared.errors import UserError, run_cli  # noqa: E402

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)")
_REFERENCES = re.compile(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)")
_ALL_REDUCE = re.compile(r"=\s*(.+?)\s+all-reduce(?:-start)?\(")


def parse_hlo(text: str) -> tuple[dict[str, set[str]], dict[str, list[int]], set[str]]:
    """(computation -> computations it calls, computation -> bytes of each all-reduce in it, While bodies)."""
    calls: dict[str, set[str]] = {}
    reduces: dict[str, list[int]] = {}
    bodies: set[str] = set()
    current = None
    for line in text.splitlines():
        # A computation's header is the only unindented line that opens a block (its instructions are indented).
        match = _COMPUTATION.match(line) if not line.startswith(" ") and line.rstrip().endswith("{") else None
        if match:
            current = match.group(1)
            calls.setdefault(current, set())
            reduces.setdefault(current, [])
            continue
        if current is None:
            continue
        for group in _REFERENCES.findall(line):
            calls[current].update(name.strip().lstrip("%") for name in group.split(","))
        if " while(" in line and (body := re.search(r"body=%?([\w.\-]+)", line)):
            bodies.add(body.group(1))
        if reduce := _ALL_REDUCE.search(line):
            reduces[current].append(shape_bytes(reduce.group(1)))
    return calls, reduces, bodies


def reachable(calls: dict[str, set[str]], roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(calls.get(name, ()))
    return seen


def count_all_reduces(text: str) -> dict[str, float]:
    """All-reduces (count, MB per run) inside the While loops (per micro-step) and outside (per step)."""
    calls, reduces, bodies = parse_hlo(text)
    inside = reachable(calls, bodies)
    loop = [b for name in inside for b in reduces.get(name, [])]
    rest = [b for name, sizes in reduces.items() if name not in inside for b in sizes]
    return {"loops": len(bodies), "in_loop": len(loop), "in_loop_mb": sum(loop) / 1e6,
            "outside": len(rest), "outside_mb": sum(rest) / 1e6}


def step_module(dump_dir: Path) -> Path:
    """The largest optimized module in the dump that holds a While loop: the training step."""
    candidates = [p for p in dump_dir.glob("*after_optimizations.txt") if " while(" in p.read_text()]
    if not candidates:
        raise UserError(f"{dump_dir}: no optimized module with a While loop (was the accumulation loop on?)")
    return max(candidates, key=lambda p: p.stat().st_size)


def train_and_dump(preset: str, seq_len: int, accum: int, dump_dir: Path, torch_xla_accum: bool = False) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump_dir} --xla_dump_hlo_as_text"
                               " --xla_dump_hlo_pass_re=^$").strip()
    from shared.tpu import default_xla_env

    default_xla_env()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_mfu import write_random_shards

    from shared.config import GPT2_VOCAB_SIZE, TrainConfig
    from shared.train.device import make_runtime
    from shared.train.trainer import train

    runtime = make_runtime("xla")
    runtime.accum_impl = "torch_xla" if torch_xla_accum else "own"
    micro = runtime.num_devices
    data = dump_dir.parent / "data"
    write_random_shards(data, 4 * micro * seq_len * accum + 1, GPT2_VOCAB_SIZE)
    cfg = TrainConfig(preset=preset, seq_len=seq_len, data_dir=str(data), out_dir=str(dump_dir.parent / "run"),
                      micro_batch=micro, total_batch_tokens=micro * seq_len * accum, max_steps=2, log_every=1,
                      eval_every=0, checkpoint_every=0, progress=False, wandb_project="", xla_cache=False,
                      backend="xla")
    train(cfg, runtime, log=lambda *a, **k: None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--hlo", default="", help="count this HLO text file instead of training")
    parser.add_argument("--torch-xla-accum", action="store_true",
                        help="train with torch_xla's gradient_accumulation helper instead of the project's loop")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="count-allreduce-") as tmp:
        if args.hlo:
            path = Path(args.hlo)
        else:
            dump = Path(tmp) / "dump"
            train_and_dump(args.preset, args.seq_len, args.accum, dump, args.torch_xla_accum)
            path = step_module(dump)
        counts = count_all_reduces(path.read_text())
        loop = "torch_xla's gradient_accumulation" if args.torch_xla_accum else "the project's loop"
        what = f"{args.preset}, T={args.seq_len}, accumulation {args.accum}, {loop}" if not args.hlo else str(path)
        print(f"step module: {path.name} ({what})")
        print(f"While loops: {counts['loops']}")
        print(f"all-reduces inside the loop (each run once per micro-step): {counts['in_loop']}, "
              f"{counts['in_loop_mb']:.1f} MB per micro-step")
        print(f"all-reduces outside the loop (once per step): {counts['outside']}, {counts['outside_mb']:.1f} MB")
        if not args.hlo:
            per_step = counts["in_loop_mb"] * args.accum + counts["outside_mb"]
            print(f"all-reduced per optimizer step: {per_step:.1f} MB")


if __name__ == "__main__":
    run_cli(main)
