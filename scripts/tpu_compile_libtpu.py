"""Compile a traced train step (shared/runtime/step_trace.py's files) for a TPU topology with libtpu's compile-only
client, and write what the compiler says: memory per chip, the TPU-optimized HLO (as its dump writes it), the
compile time.

Runs in the TPU compiler's virtualenv (.venv-tpu: jax and libtpu as Kaggle's TPU image pins them), not the
project's; it imports jax, numpy and the standard library only. scripts/tpu_compile.py runs it:

    .venv-tpu/bin/python scripts/tpu_compile_libtpu.py TRACE_DIR v5e:2x4 2,4,1

Shardings: torch_xla writes those of the step's real inputs (the batch, the schedule's scalars); the placeholders
(parameters, optimizer state) get theirs here from the trace's record, matched by type. Each updated output is
donated to an input of its type and sharding, as torch_xla donates a tensor updated in place, so the memory is
the session's.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

MLIR_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "int32": "i32", "int64": "i64", "bool": "i1"}
RESULT_FILE, OPTIMIZED_HLO_FILE = "compiled.json", "optimized.hlo.txt"


def type_key(shape: list, dtype: str) -> str:
    """The MLIR tensor type of a recorded input: `tensor<50304x768xf32>`."""
    return "tensor<" + "".join(f"{d}x" for d in shape) + MLIR_DTYPES[dtype] + ">"


def input_shardings(inputs: list[dict]) -> dict[str, str]:
    """Sharding by tensor type; one type with two layouts can't be told apart, and is an error."""
    found: dict[str, str] = {}
    for record in inputs:
        key = type_key(record["shape"], record["dtype"])
        if found.setdefault(key, record["sharding"]) != record["sharding"]:
            raise SystemExit(f"error: inputs of type {key} are laid out two ways ({found[key]}, "
                             f"{record['sharding']}): the compiler's shardings can't be matched to them")
    return found


def annotate(module, meta: dict) -> int:
    """Set each argument's sharding where torch_xla left none, each updated output's sharding, and donate each
    updated output to an unused argument of the same type and sharding. Returns the number donated."""
    from jax._src.lib.mlir import ir

    main = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "main")
    ftype = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
    by_type = input_shardings(meta["inputs"])
    given = [ir.DictAttr(a) for a in ir.ArrayAttr(main.attributes["arg_attrs"])] \
        if "arg_attrs" in main.attributes else [None] * len(ftype.inputs)
    args = []
    for arg_type, attrs in zip(ftype.inputs, given, strict=True):
        if attrs is not None and "mhlo.sharding" in attrs:
            sharding = ir.StringAttr(attrs["mhlo.sharding"]).value
        else:
            sharding = by_type.get(str(arg_type), "{replicated}")
        args.append({"type": str(arg_type), "sharding": sharding, "alias": None})
    results = []
    for index, result_type in enumerate(ftype.results):
        updated = index < meta["updated_outputs"]
        sharding = by_type.get(str(result_type), "{replicated}") if updated else "{replicated}"
        results.append(sharding)
        if updated:
            free = next((a for a in args if a["alias"] is None and a["type"] == str(result_type)
                         and a["sharding"] == sharding), None)
            if free is not None:
                free["alias"] = index
    i32 = ir.IntegerType.get_signless(32)
    main.attributes["arg_attrs"] = ir.ArrayAttr.get([ir.DictAttr.get(
        {"mhlo.sharding": ir.StringAttr.get(a["sharding"]),
         **({"tf.aliasing_output": ir.IntegerAttr.get(i32, a["alias"])} if a["alias"] is not None else {})})
        for a in args])
    main.attributes["res_attrs"] = ir.ArrayAttr.get([ir.DictAttr.get({"mhlo.sharding": ir.StringAttr.get(s)})
                                                     for s in results])
    return sum(a["alias"] is not None for a in args)


def compile_step(trace_dir: Path, topology: str, chips_per_host: tuple[int, int, int]) -> dict:
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata server here: libtpu's lookups are noise
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # no chips to lock: compiles may run side by side
    import jax

    jax.config.update("jax_use_shardy_partitioner", False)  # torch_xla's HLO carries GSPMD shardings
    import numpy as np
    from jax._src import compiler
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib import _jax, xla_client
    from jax._src.lib.mlir import ir
    from jax.experimental import topologies

    meta = json.loads((trace_dir / "step.json").read_text())
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                           chips_per_host_bounds=chips_per_host).devices
    if len(devices) != meta["num_devices"]:
        raise SystemExit(f"error: the step was traced for {meta['num_devices']} devices, {topology} has "
                         f"{len(devices)}")
    text = _jax.mlir.hlo_to_stablehlo((trace_dir / "step.hlo.pb").read_bytes())
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        donated = annotate(module, meta)
        options = compiler.get_compile_options(num_replicas=1, num_partitions=len(devices),
                                               device_assignment=np.array(devices).reshape(1, len(devices)))
        # The optimized module as the compiler writes it: asking the executable for its text (hlo_modules()) took
        # 17 GB and a minute more for gpt2's step; the dump, nothing.
        debug = options.executable_build_options.debug_options
        debug.xla_dump_to, debug.xla_dump_hlo_as_text = str(trace_dir / "dump"), True
        started = time.monotonic()
        try:
            executable = _compile(devices[0].client, module, xla_client.DeviceList(tuple(devices)), options)
        except Exception as err:  # the compiler's own refusal: the step's buffers exceed the chip's HBM
            result = out_of_memory(str(err), time.monotonic() - started, devices, topology, jax.__version__)
            if result is None:
                raise
            (trace_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
            return result
        seconds = time.monotonic() - started
    stats = executable.get_compiled_memory_stats()
    total = compiler_total_bytes(trace_dir / "dump")
    optimized = max((trace_dir / "dump").glob("*.after_optimizations.txt"), key=lambda p: p.stat().st_size)
    optimized.replace(trace_dir / OPTIMIZED_HLO_FILE)
    result = {"device_kind": devices[0].device_kind, "devices": len(devices), "topology": topology,
              "compile_s": round(seconds, 1), "donated_inputs": donated, "jax": jax.__version__,
              "libtpu": _libtpu_version(),
              "memory": {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
                         "aliased": stats.alias_size_in_bytes, "temps": stats.temp_size_in_bytes,
                         "code": stats.generated_code_size_in_bytes,
                         "host_temps": getattr(stats, "host_temp_size_in_bytes", 0),
                         "peak": getattr(stats, "peak_memory_in_bytes", 0), "compiler_total": total}}
    (trace_dir / RESULT_FILE).write_text(json.dumps(result, indent=1))
    return result


def _compile(client, module, devices, options):
    """The client's compile of the module: its bytecode for jax 0.7's client (Kaggle's pins), the module itself for
    newer ones (jax 0.10.2's compile-only client refuses bytes, as its own jax._src.compiler no longer passes them)."""
    from jax._src.interpreters import mlir as jax_mlir

    try:
        return client.compile(jax_mlir.module_to_bytecode(module), devices, options)
    except TypeError:
        return client.compile(module, devices, options)


_TOTAL = re.compile(r"^Total bytes used: (\d+)", re.M)


def compiler_total_bytes(dump_dir: Path) -> int:
    """The compiler's own total of a chip's memory for the step, from the memory-usage report its dump writes
    (`Total bytes used: N`: the arguments, the temp block its buffer assignment packed, the code), 0 where there is
    none. It is the figure the compiler's out-of-memory refusal names, within about 0.1 GiB ("Used 15.82G of
    15.75G hbm" for a report of 15.82 GiB); get_compiled_memory_stats' arguments + temps count more than it
    (libtpu 0.0.17: temp_size_in_bytes is not the temp block alone)."""
    reports = sorted(dump_dir.glob("*after_optimizations-memory-usage-report.txt"), key=lambda p: p.stat().st_size)
    found = _TOTAL.search(reports[-1].read_text()) if reports else None
    return int(found.group(1)) if found else 0


_OOM = re.compile(r"Ran out of memory in memory space hbm\. Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}  # XLA's human-readable bytes are binary


def out_of_memory(message: str, seconds: float, devices, topology: str, jax_version: str) -> dict | None:
    """The compile's result where the compiler refused the step for HBM (its figures: used and capacity)."""
    found = _OOM.search(message)
    if not found:
        return None
    used, capacity = (float(found.group(i)) * _UNITS[found.group(i + 1)] for i in (1, 3))
    return {"device_kind": devices[0].device_kind, "devices": len(devices), "topology": topology,
            "compile_s": round(seconds, 1), "jax": jax_version, "libtpu": _libtpu_version(),
            "out_of_memory": {"used": used, "capacity": capacity, "message": found.group(0)}}


def _libtpu_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libtpu")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    trace, topology_name, bounds = sys.argv[1:4]
    print(json.dumps(compile_step(Path(trace), topology_name, tuple(int(b) for b in bounds.split(",")))))
