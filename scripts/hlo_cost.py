"""What a TPU-optimized HLO module (one chip's program after SPMD partitioning) costs per run, read from its text:
each While loop's trip count (its condition's bound), how often each computation runs, the FLOPs of its matmuls
(convolutions and dots, inside fusions too), the HBM bytes its top-level ops move (each op's operands read and
result written once: a fusion's intermediates stay on chip), and its collectives, inside and outside the loops.

All of it is an estimate from the compiler's output, not a measurement: `roofline` turns it into a lower bound on
the step's time on a chip of given peak FLOP/s, HBM and ICI bandwidth. Standard library only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "pred": 1, "s8": 1, "u8": 1,
               "f64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s")
COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")
# Ops that move no HBM bytes of their own: bookkeeping, control flow (their computations are counted), collectives
# (counted on the interconnect), and the ends of async pairs (the start carries the shapes).
_NO_BYTES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
             "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done", "all-reduce-done",
             "all-gather-done", "collective-permute-done", "async-done", "async-update", "custom-call"}


def shape_dims(shape: str) -> list[tuple[str, list[int]]]:
    """Each array of an HLO shape (an array or a tuple): (dtype, dims)."""
    return [(dtype, [int(d) for d in dims.split(",") if d]) for dtype, dims in _ARRAY.findall(shape)]


def shape_bytes(shape: str) -> int:
    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in shape_dims(shape))


@dataclass
class Instruction:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    args: str  # the text inside the op's parentheses (a constant's value)
    root: bool = False


@dataclass
class Computation:
    name: str
    entry: bool
    instructions: list[Instruction] = field(default_factory=list)
    shapes: dict[str, str] = field(default_factory=dict)  # instruction (or parameter) name -> shape


def _split_call(rest: str) -> tuple[str, str]:
    """The text inside an op's parentheses, and the attributes after them."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def parse_module(text: str) -> dict[str, Computation]:
    computations: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        if not line.startswith(" ") and line.rstrip().endswith("{"):
            header = _HEADER.match(line)
            if header:
                current = computations.setdefault(header.group(2), Computation(header.group(2), bool(header.group(1))))
            continue
        match = _INSTRUCTION.match(line) if current else None
        if not match:
            continue
        root, name, shape, op, rest = match.groups()
        inside, attrs = _split_call(rest)
        instruction = Instruction(name, shape, op, re.findall(r"%([\w.\-]+)", inside), attrs, inside, bool(root))
        current.instructions.append(instruction)
        current.shapes[name] = shape
    return computations


def _called(attrs: str, key: str) -> list[str]:
    found = re.search(key + r"=\{?([^}]*?)(?:\}|,\s*[a-z_]+=|$)", attrs)
    return [n.strip().lstrip("%") for n in found.group(1).split(",") if n.strip()] if found else []


def trip_count(condition: Computation) -> int | None:
    """A counted loop's bound: its condition compares the counter with an integer constant (LT)."""
    constants = {i.name: int(i.args) for i in condition.instructions
                 if i.op == "constant" and re.fullmatch(r"\s*-?\d+\s*", i.args)}
    for i in condition.instructions:
        if i.op == "compare" and "direction=LT" in i.attrs:
            bound = [constants[o] for o in i.operands if o in constants]
            if bound:
                return bound[0]
    return None


def conv_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """2 x output elements x the multiply-adds behind each: a dot's contracted size; a convolution's input
    features times, per spatial dimension, the window's taps that can meet real input (XLA:TPU writes batched and
    per-head matmuls as convolutions whose windows mostly cover padding or an lhs dilation's zeros)."""
    out = math.prod(d for _, dims in shape_dims(instruction.shape)[:1] for d in dims)
    lhs = shape_dims(shapes.get(instruction.operands[0], "")) if instruction.operands else []
    if instruction.op == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attrs)
        if not lhs or not contracting:
            return 0.0
        return 2.0 * out * math.prod(lhs[0][1][int(d)] for d in contracting.group(1).split(",") if d)
    kernel = shape_dims(shapes.get(instruction.operands[1], "")) if len(instruction.operands) > 1 else []
    labels = re.search(r"dim_labels=(\w+)_(\w+)->", instruction.attrs)
    if not lhs or not kernel or not labels or len(labels.group(2)) != len(kernel[0][1]) \
            or len(labels.group(1)) != len(lhs[0][1]):
        return 0.0
    lhs_labels, kernel_labels = labels.group(1), labels.group(2)
    dilation = re.search(r"lhs_dilate=([\dx]+)", instruction.attrs)
    dilate = [int(d) for d in dilation.group(1).split("x")] if dilation else []
    taps = 1
    for label, size in zip(kernel_labels, kernel[0][1], strict=True):
        if label == "i":
            taps *= size
        elif label.isdigit():
            spatial = int(label)
            d = dilate[spatial] if spatial < len(dilate) else 1
            taps *= min(math.ceil(size / d), lhs[0][1][lhs_labels.index(label)])
    return 2.0 * out * taps


@dataclass
class Collective:
    kind: str
    bytes: int
    in_loop: bool
    runs: int  # per step


@dataclass
class StepCost:
    """Per chip, per run of the module (one optimizer step)."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    roofline_ops_s: float = 0.0  # sum over ops of max(FLOPs / peak, bytes / HBM bandwidth), times their runs
    collectives: list[Collective] = field(default_factory=list)
    loops: dict[str, int | None] = field(default_factory=dict)  # While body -> trip count
    ops: list[OpCost] = field(default_factory=list)  # each op that moves bytes or runs FLOPs, runs applied
    # Pallas (Mosaic) kernels: opaque to the HLO, so their FLOPs are unknown here; the bytes of their operands and
    # results, runs applied, are in `kernel_bytes` (not in hbm_bytes or roofline_ops_s).
    kernel_calls: int = 0
    kernel_bytes: float = 0.0


@dataclass
class OpCost:
    """One op's share of a step, its runs applied: where the roofline's time goes."""

    name: str
    op: str  # the HLO opcode (a fusion's is "fusion")
    shape: str  # its result
    runs: int
    flops: float
    hbm_bytes: float
    roofline_s: float


def _fused_flops(computations: dict[str, Computation], name: str) -> float:
    comp = computations.get(name)
    if comp is None:
        return 0.0
    total = 0.0
    for i in comp.instructions:
        if i.op in ("convolution", "dot"):
            total += conv_flops(i, comp.shapes)
        elif i.op == "fusion":
            total += sum(_fused_flops(computations, c) for c in _called(i.attrs, "calls"))
    return total


def step_cost(text: str, peak_flops: float, hbm_bytes_per_s: float, default_trip: int = 1) -> StepCost:
    """The module's cost, per chip and run: FLOPs, HBM bytes, the per-op roofline time and the collectives.
    `default_trip`: a loop's trip count where its condition does not say."""
    computations = parse_module(text)
    cost = StepCost()
    entry = next((c for c in computations.values() if c.entry), None)
    if entry is None:
        return cost
    _walk(computations, entry.name, 1, False, cost, peak_flops, hbm_bytes_per_s, default_trip)
    return cost


def _walk(computations: dict[str, Computation], name: str, runs: int, in_loop: bool, cost: StepCost,
          peak_flops: float, hbm_bytes_per_s: float, default_trip: int) -> None:
    comp = computations.get(name)
    if comp is None:
        return
    for i in comp.instructions:
        if i.op == "while":
            body, condition = _called(i.attrs, "body"), _called(i.attrs, "condition")
            trips = trip_count(computations[condition[0]]) if condition and condition[0] in computations else None
            if body:
                cost.loops[body[0]] = trips
                _walk(computations, body[0], runs * (trips or default_trip), True, cost, peak_flops,
                      hbm_bytes_per_s, default_trip)
            continue
        if i.op in ("conditional", "call"):
            for callee in _called(i.attrs, "branch_computations") + _called(i.attrs, "to_apply") \
                    + _called(i.attrs, "true_computation") + _called(i.attrs, "false_computation"):
                _walk(computations, callee, runs, in_loop, cost, peak_flops, hbm_bytes_per_s, default_trip)
            continue
        kind = next((k for k in COLLECTIVES if i.op in (k, k + "-start")), None)
        if kind:
            operand = sum(shape_bytes(comp.shapes.get(o, "")) for o in i.operands)
            # What the collective is about: a reduce-scatter's whole input, else its (whole) result; an async
            # start's result also holds its operands, so an all-reduce-start is its operands.
            size = operand if kind == "reduce-scatter" or i.op == "all-reduce-start" else shape_bytes(i.shape)
            cost.collectives.append(Collective(kind, size, in_loop, runs))
            continue
        if i.op == "custom-call" and 'custom_call_target="tpu_custom_call"' in i.attrs:
            cost.kernel_calls += runs
            cost.kernel_bytes += (shape_bytes(i.shape) + sum(shape_bytes(comp.shapes.get(o, "")) for o in i.operands)
                                  ) * runs
            continue
        if i.op in _NO_BYTES:
            continue
        moved = _moved_bytes(computations, comp, i)
        flops = conv_flops(i, comp.shapes) if i.op in ("convolution", "dot") else \
            sum(_fused_flops(computations, c) for c in _called(i.attrs, "calls")) if i.op == "fusion" else 0.0
        seconds = max(flops / peak_flops, moved / hbm_bytes_per_s) * runs
        cost.flops += flops * runs
        cost.hbm_bytes += moved * runs
        cost.roofline_ops_s += seconds
        cost.ops.append(OpCost(i.name, i.op, i.shape, runs, flops * runs, moved * runs, seconds))


# Each generation's MXU: a systolic array of width x width multiply-accumulators. v5e: 4 MXUs a TensorCore
# (https://cloud.google.com/tpu/docs/v5e), each 128 x 128 (https://cloud.google.com/tpu/docs/system-architecture-tpu-vm,
# "composed of 128 x 128 multiply/accumulators"); v6e: two 256 x 256 MXUs a TensorCore
# (https://cloud.google.com/tpu/docs/v6e).
MXU_WIDTH = {"v5e": 128, "v6e": 256}


def mxu_efficiency(head_dim: int, mxu_width: int) -> float:
    """The share of an MXU an attention kernel's matmuls can fill: each of them (q.k^T and dO.v^T contract over the
    head dim D; p.v, dS.k, dS^T.q and p^T.dO produce D columns) has D on a side of the array, so at most D of its
    `mxu_width` rows or columns hold values. A model, not a measurement: it assumes the kernel's compiler does not
    stream the D side instead, which would fill the array for the 4 matmuls whose output D sets."""
    return min(1.0, head_dim / mxu_width)


def kernel_seconds(kernel_flops: float, kernel_bytes: float, peak_flops: float, hbm_bytes_per_s: float,
                   efficiency: float = 1.0) -> float:
    """The Pallas kernels' share of a roofline: their FLOPs at `efficiency` of peak, or their operands' and
    results' bytes at HBM bandwidth, whichever is longer."""
    return max(kernel_flops / (peak_flops * efficiency), kernel_bytes / hbm_bytes_per_s)


def top_ops(cost: StepCost, n: int = 20) -> list[OpCost]:
    """The n ops that take the most of the roofline's time."""
    return sorted(cost.ops, key=lambda o: o.roofline_s, reverse=True)[:n]


def _moved_bytes(computations: dict[str, Computation], comp: Computation, i: Instruction) -> int:
    """HBM bytes an op reads and writes: its operands and result; an async start (its result holds its operands)
    and an in-place update (dynamic-update-slice, alone or as a fusion's root) only the part they write, twice."""
    operands = [shape_bytes(comp.shapes.get(o, "")) for o in i.operands]
    if i.op.endswith("-start"):
        return 2 * max(shape_bytes(i.shape) - sum(operands), 0)
    root = i.op
    if i.op == "fusion":
        fused = computations.get(next(iter(_called(i.attrs, "calls")), ""))
        root = next((f.op for f in fused.instructions if f.root), "") if fused else ""
    if root == "dynamic-update-slice" and operands:
        return 2 * (sum(operands) - max(operands))  # all but the buffer updated in place
    return shape_bytes(i.shape) + sum(operands)


def collective_seconds(collective: Collective, devices: int, ici_bytes_per_s: float) -> float:
    """A ring's lower bound on one run: an all-reduce moves 2(n-1)/n of its bytes through each chip, an all-gather
    or reduce-scatter (n-1)/n of the whole, a permute or all-to-all its bytes once."""
    share = {"all-reduce": 2 * (devices - 1) / devices, "all-gather": (devices - 1) / devices,
             "reduce-scatter": (devices - 1) / devices}.get(collective.kind, 1.0)
    return share * collective.bytes / ici_bytes_per_s



def main() -> None:
    """`python scripts/hlo_cost.py DIR/v5e-8/optimized.hlo.txt [--top 20]`: a kept step's roofline
    (scripts/tpu_compile.py --keep DIR), its collectives inside and outside the loops, and the ops that take the
    most of it. The chip's figures default to a v5e
    chip's (scripts/tpu_compile_step.py TPUS); for a v6e chip: --peak-tflops 918 --hbm-gbps 1640."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("hlo", help="an optimized HLO module's text (optimized.hlo.txt)")
    parser.add_argument("--peak-tflops", type=float, default=197.0, help="bf16 peak a chip (v5e: 197)")
    parser.add_argument("--hbm-gbps", type=float, default=819.0, help="HBM bandwidth a chip (v5e: 819)")
    parser.add_argument("--top", type=int, default=20, help="how many ops to list")
    args = parser.parse_args()
    with open(args.hlo) as f:
        cost = step_cost(f.read(), args.peak_tflops * 1e12, args.hbm_gbps * 1e9)
    print(f"per chip a run: {cost.flops / 1e12:.2f} TFLOP in the HLO, HBM traffic {cost.hbm_bytes / 1e9:.1f} GB, "
          f"ops {cost.roofline_ops_s * 1e3:.1f} ms at peak or HBM bandwidth; Pallas kernels: {cost.kernel_calls} "
          f"calls, {cost.kernel_bytes / 1e9:.1f} GB")
    for in_loop, per in ((True, "each run of the loop's body"), (False, "a run")):
        found = [c for c in cost.collectives if c.in_loop == in_loop]
        kinds = ", ".join(f"{kind} {n}" for kind in COLLECTIVES if (n := sum(c.kind == kind for c in found)))
        print(f"collectives {'inside' if in_loop else 'outside'} the loops: {kinds or 'none'}; "
              f"{sum(c.bytes for c in found) / 1e6:.1f} MB {per}")
    for op in top_ops(cost, args.top):
        print(f"{op.roofline_s * 1e3:8.1f} ms {op.hbm_bytes / 1e9:7.1f} GB {op.flops / 1e12:6.2f} TFLOP x{op.runs:<4d} "
              f"{op.op:<12s} {op.name}  {op.shape[:80]}")


if __name__ == "__main__":
    main()
