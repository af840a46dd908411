"""Lines scripts/tpu_compile.py adds to its report: the MFU ceiling with the Pallas kernels charged at their head
dim's share of the MXU, and how the step compiled by a second libtpu (`--tpu-python`) differs from the first's in
its collectives inside the accumulation loop. Each reads the reports' dicts (scripts/tpu_compile_step.py analyse)."""

from __future__ import annotations

import argparse

from shared.errors import UserError


def check_tpu_python(args: argparse.Namespace) -> None:
    """`--tpu-python` names an interpreter, and compiles: one line where it cannot."""
    if args.tpu_python is None:
        return
    if args.trace_only or args.analyse:
        raise UserError("--tpu-python compiles the step: it does not go with --trace-only or --analyse")
    if not args.tpu_python.is_file():
        raise UserError(f"--tpu-python {args.tpu_python}: no such interpreter (a virtualenv's bin/python with "
                        "jax[tpu])")


def mxu_lines(r: dict) -> list[str]:
    """The ceiling with the kernels at the head-dim-aware MXU rate; none where the step has no Pallas kernel."""
    if not r.get("kernel_calls") or "mfu_ceiling_mxu" not in r:
        return []
    return [f"MFU ceiling with the Pallas kernels' matmuls at head dim {r['head_dim']}'s share of a "
            f"{r['mxu_width']}-wide MXU ({r['mxu_efficiency']:.0%}; a model, scripts/hlo_cost.py mxu_efficiency): "
            f"{r['mfu_ceiling_mxu']:.1%} (kernels {r['kernel_mxu_s'] * 1e3:.1f} ms, a step "
            f"{r['step_mxu_s'] * 1e3:.1f} ms)"]


def _inside(r: dict) -> dict[str, tuple[int, int]]:
    """Collectives inside the loop by kind: (count, bytes a micro-step)."""
    return {g["kind"]: (g["count"], g["bytes"]) for g in r.get("collectives", []) if g["where"] == "inside"}


def compare_lines(base: dict, other: dict) -> list[str]:
    """How `other` (the step compiled by another libtpu) differs from `base` in its collectives inside the loop and
    its ceilings: one line a collective kind found inside the loop by either (all-reduce always), then the ceiling.
    """
    name, base_name = f"libtpu {other['versions']['libtpu']}", base["versions"]["libtpu"]
    if "compiler_says" in other or "compiler_says" in base:
        refused = [f"libtpu {r['versions']['libtpu']}" for r in (base, other) if "compiler_says" in r]
        return [f"{name} against {base_name}: {' and '.join(refused)} refused the step, nothing to compare"]
    inside, base_inside = _inside(other), _inside(base)
    lines = []
    for kind in ["all-reduce", *sorted(k for k in {*inside, *base_inside} if k != "all-reduce")]:
        count, size = inside.get(kind, (0, 0))
        base_count, base_size = base_inside.get(kind, (0, 0))
        lines.append(f"{name}: {kind} inside the loop {count}, {size / 1e6:.1f} MB per micro-step ({base_name}: "
                     + (f"{base_count}, {base_size / 1e6:.1f} MB" if base_count else "0") + ")")
    ceiling = f"{name}: MFU ceiling {other['mfu_ceiling']:.1%} ({base_name}: {base['mfu_ceiling']:.1%})"
    if "mfu_ceiling_mxu" in other and other.get("kernel_calls"):
        ceiling += (f", with the kernels at the head dim's MXU share {other['mfu_ceiling_mxu']:.1%} ({base_name}: "
                    f"{base.get('mfu_ceiling_mxu', 0):.1%})")
    return [*lines, ceiling]
