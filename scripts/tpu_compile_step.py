"""The train step compiled for a TPU board by Kaggle's TPU compiler (libtpu's compile-only client, in .venv-tpu),
as a library: `compile_step` (traced on torch_xla's CPU devices, compiled, cached by settings and versions),
`analyse` (the compiler's memory figures and the HLO's costs, per chip) and `report_lines`. The command
(scripts/tpu_compile.py) and the chain (`--plan`, `--smoke`: scripts/chain/plan.py, scripts/chain/smoke.py) both
import it; it imports neither. How the step is traced, and which attention kernel it is traced with, is
scripts/tpu_compile.py's docstring.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.tpu_compile_report import mxu_lines
from shared.errors import UserError
from shared.model.attention import SDPA, SETTING_OF
from shared.runtime.mosaic_version import libtpu_build_date, version_for_libtpu
from shared.runtime.mosaic_version import readable_version as readable_mosaic_version
from shared.runtime.step_trace import MOSAIC_VERSION_ENV

REPO = Path(__file__).resolve().parents[1]
CACHE_DIR = Path(os.environ.get("TPU_COMPILE_CACHE") or Path.home() / ".cache" / "gpt2-on-kaggle" / "tpu-compile")
# Kaggle's TPU boards (one host, 8 chips): the compile-only topology and its per-chip figures. HBM bandwidth and
# ICI (bidirectional, per chip) from Google's pages: https://cloud.google.com/tpu/docs/v5e (819 GBps, 400 GBps)
# and https://cloud.google.com/tpu/docs/v6e (1640 GBps; 3584 Gbps = 448 GBps); peak bf16 in shared/tpu.py.
TPUS = {"v5e-8": {"generation": "v5e", "topology": "v5e:2x4", "chips_per_host": (2, 4, 1), "hbm_bw": 819e9,
                  "ici_bw": 400e9},
        "v6e-8": {"generation": "v6e", "topology": "v6e:2x4", "chips_per_host": (2, 4, 1), "hbm_bw": 1640e9,
                  "ici_bw": 448e9},
        # Not on Kaggle: a 4-host slice (4 chips a host, libtpu's default layout), to show the same SPMD step
        # compiles past one host.
        "v5e-16": {"generation": "v5e", "topology": "v5e:4x4", "chips_per_host": (2, 2, 1), "hbm_bw": 819e9,
                   "ici_bw": 400e9}}
KAGGLE_TPUS = ("v5e-8", "v6e-8")
# libtpu without a TPU: no metadata server to ask, and no lock on the (absent) chips, so that two compiles (two
# TPUs, two test workers) may run at once; a process that opens real chips never runs here.
COMPILER_ENV = {"TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
TIGHT_FREE_FRACTION = 0.05  # under this much HBM left, a fit is called tight (the runtime takes some too)


def compiler_python() -> Path | None:
    """The TPU compiler's interpreter: $TPU_COMPILER_PYTHON, else .venv-tpu's; None where neither exists, or
    where TPU_COMPILER_PYTHON is `off` (the test suite's default: a check compiles only where a test asks)."""
    if os.environ.get("TPU_COMPILER_PYTHON") == "off":
        return None
    path = Path(os.environ.get("TPU_COMPILER_PYTHON") or REPO / ".venv-tpu" / "bin" / "python")
    return path if path.exists() else None


def _versions(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "from importlib.metadata import version as v; "
                          "print(v('jax'), v('jaxlib'), v('libtpu'))"], capture_output=True, text=True)
    return out.stdout.strip()


def cache_key(settings: dict, tpu: str, compiler: str) -> str:
    """The step's settings, the TPU, the compiler's versions and flags (LIBTPU_INIT_ARGS, which libtpu reads here
    too), torch_xla's version, the step's code (all of shared/: `micro_batch: auto` is resolved by shared/tpu.py)
    and this tool's own (what it reads from the compiler)."""
    from importlib.metadata import version

    sources = [*sorted((REPO / "shared").rglob("*.py")), *sorted((REPO / "scripts").glob("tpu_compile*.py")),
               REPO / "scripts" / "hlo_cost.py"]
    code = b"".join(p.read_bytes() for p in sources)
    flags = os.environ.get("LIBTPU_INIT_ARGS", "")
    blob = json.dumps([settings, tpu, compiler, flags, version("torch_xla")], sort_keys=True).encode() + code
    return hashlib.sha256(blob).hexdigest()[:16]


def traced_attention(settings: dict, generation: str) -> str:
    """The kernel the step of train `settings` is traced with on TPU `generation`: the first a session tries at its
    sequence length for the settings' `attention` (shared/model/attention.py), so a step no session runs (flash at
    32 tokens) is never traced: the one it runs instead is."""
    from shared.config import TrainConfig
    from shared.model.attention import candidates

    cfg = TrainConfig.from_dict(settings)
    return candidates(generation, cfg.model.shape.block_size, cfg.step.attention)[0]


def compile_step(settings: dict, tpu: str, log=print, cache_dir: Path = CACHE_DIR, keep: Path | None = None,
                 attention: str | None = None, trace_only: Path | None = None, python: Path | None = None) -> dict:
    """The compiler's report on the step of train `settings` (TrainConfig fields) on Kaggle's `tpu` ("v5e-8"),
    cached. `attention`: the train setting (default: the settings' own, else auto): "auto", the step a session runs
    where the first kernel it tries passes its probe; "splash", "flash" or "sdpa", the step where that kernel's
    does (flash: splash's failed; sdpa: every probe failed), each the kernel a session would try in its place where
    the sequence length rules it out (`traced_attention`). With `keep`, compiled afresh and its trace (the
    optimized HLO text among it) copied to keep/<tpu>.
    With `trace_only`, only traced, into trace_only/<tpu> (returns {}): a larger machine compiles it
    (scripts/tpu_compile_libtpu.py) and `--analyse` reads it back.
    `python`: the TPU compiler's interpreter (another virtualenv's jax and libtpu), else compiler_python()'s.
    Raises UserError where the TPU compiler is not installed or the step does not compile."""
    from shared.config import TrainConfig

    if attention is not None:
        settings = {**settings, "attention": attention}
    TrainConfig.from_dict(settings)  # bad settings are one line before anything is traced
    python = python or compiler_python()
    if python is None:
        raise UserError("the TPU compiler is not installed (.venv-tpu: jax and libtpu as Kaggle's image pins them); "
                        "run bash scripts/setup.sh")
    target = TPUS[tpu]
    attention = traced_attention(settings, target["generation"])
    # Traced from that kernel on, as the session that runs it: settings that trace the same step share a report.
    settings = {**settings, "attention": SETTING_OF[attention]}
    key = cache_key(settings, tpu, _versions(python))
    cached = cache_dir / key / "report.json"
    if cached.exists() and keep is None and trace_only is None:
        return {**json.loads(cached.read_text()), "cached": True}
    with tempfile.TemporaryDirectory(prefix="tpu-compile-") as tmp:
        work = Path(tmp)
        (work / "settings.json").write_text(json.dumps(settings))
        log(f"tracing the step for {tpu} (torch_xla, {chips(target)} CPU devices, nothing run) ...")
        env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(chips(target)),
               "PYTHONPATH": str(REPO)}
        trace = [sys.executable, "-m", "shared.runtime.step_trace", str(work / "settings.json"), str(work / "trace"),
                 target["generation"]]
        bounds = ",".join(str(b) for b in target["chips_per_host"])
        compile_cmd = [str(python), str(REPO / "scripts" / "tpu_compile_libtpu.py"), str(work / "trace"),
                       target["topology"], bounds]
        # The version jax would serialize Pallas kernels at on a TPU with this libtpu (here it has no TPU to ask).
        mosaic_version = compiler_mosaic_version(python) if attention != SDPA else None
        if mosaic_version is not None:
            env[MOSAIC_VERSION_ENV] = str(mosaic_version)
        _run(trace, env, "tracing the step")
        if trace_only is not None:  # compiled elsewhere, read back with --analyse
            shutil.copytree(work / "trace", trace_only / tpu, dirs_exist_ok=True)
            log(f"traced into {trace_only / tpu}; compile it where memory allows with: python "
                f"scripts/tpu_compile_libtpu.py {trace_only / tpu} {target['topology']} {bounds}")
            return {}
        log(f"compiling it with libtpu for {tpu} ({target['topology']}; gpt2's step takes minutes on 2 cores) ...")
        try:
            _run(compile_cmd, {**os.environ, **COMPILER_ENV}, "compiling the step")
        except UserError as err:
            mosaic_version = readable_mosaic_version(str(err))
            if mosaic_version is None:
                raise
            # jax serialized the Pallas kernel newer than this libtpu reads (its build date unread, or the ladder
            # wrong for it): as a session's probe falls back to (shared/runtime/mosaic_version.py), lower it at the
            # version libtpu names.
            log(f"libtpu reads Pallas kernels up to Mosaic version {mosaic_version}: tracing again with the kernel "
                f"lowered at {mosaic_version}, as a session does where libtpu refuses its first probe ...")
            _run(trace, {**env, MOSAIC_VERSION_ENV: str(mosaic_version)}, "tracing the step")
            _run(compile_cmd, {**os.environ, **COMPILER_ENV}, "compiling the step")
        report = {**analyse(work / "trace", tpu), "mosaic_version": mosaic_version}
        if keep is not None:
            shutil.copytree(work / "trace", keep / tpu, dirs_exist_ok=True)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(report, indent=1))
    return {**report, "cached": False}


@functools.cache
def compiler_mosaic_version(python: Path) -> int | None:
    """The highest Mosaic version the TPU compiler's libtpu reads, from its build date (None: unknown or jax's
    latest). A few seconds (libtpu starts a compile-only client), once a process: the build date is libtpu's own,
    whatever the topology asked for."""
    code = ("from jax.experimental import topologies; print(topologies.get_topology_desc(platform='tpu', "
            "topology_name='v5e:2x4', chips_per_host_bounds=(2, 4, 1)).devices[0].client.platform_version)")
    proc = subprocess.run([str(python), "-c", code], env={**os.environ, **COMPILER_ENV}, capture_output=True,
                          text=True)
    built = libtpu_build_date(proc.stdout) if proc.returncode == 0 else None
    return version_for_libtpu(built) if built else None


def chips(target: dict) -> int:
    """Chips in a topology such as `v5e:4x4`."""
    x, y, z = (int(v) for v in (target["topology"].split(":")[1].split("x") + ["1"])[:3])
    return x * y * z


def _run(cmd: list[str], env: dict, what: str) -> None:
    # At low priority: a compile takes most of a laptop's cores for minutes, and what runs beside it (a local
    # Kaggle's sessions, whose start-up their time limits count) comes first.
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, preexec_fn=lambda: os.nice(10))
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        error = next((ln for ln in reversed(lines) if ln.startswith("error:") or "Error" in ln), lines[-1] if lines
                     else f"exit {proc.returncode}")
        raise UserError(f"{what} failed: {error.removeprefix('error: ')[:400]}")


def analyse(trace_dir: Path, tpu: str) -> dict:
    """The report: the compiler's memory figures and the HLO's costs, per chip."""
    from scripts.hlo_cost import MXU_WIDTH, collective_seconds, kernel_seconds, mxu_efficiency, step_cost
    from shared.config import TrainConfig
    from shared.tpu import TPU_GENERATIONS

    target = TPUS[tpu]
    gen = TPU_GENERATIONS[target["generation"]]
    meta = json.loads((trace_dir / "step.json").read_text())
    compiled = json.loads((trace_dir / "compiled.json").read_text())
    train = TrainConfig.from_dict(meta["train"])
    head = {"tpu": tpu, "device_kind": compiled["device_kind"], "devices": compiled["devices"],
            "versions": {"jax": compiled["jax"], "libtpu": compiled["libtpu"]}, "compile_s": compiled["compile_s"],
            "preset": train.model.preset, "micro_batch": meta["micro_batch"],
            "grad_accum_steps": meta["grad_accum_steps"],
            "attention": meta["attention"], "activation_checkpointing": meta["activation_checkpointing"],
            "scan_layers": meta["scan_layers"], "fsdp": train.step.fsdp}
    if "out_of_memory" in compiled:  # the compiler refused it: its own figures, nothing else to read
        oom = compiled["out_of_memory"]
        return {**head, "fits": False, "peak_bytes": oom["used"], "hbm_bytes": oom["capacity"],
                "free_fraction": 1 - oom["used"] / oom["capacity"], "compiler_says": oom["message"]}
    cost = step_cost((trace_dir / "optimized.hlo.txt").read_text(), gen.peak_bf16_per_chip, target["hbm_bw"],
                     default_trip=meta["grad_accum_steps"])
    memory = compiled["memory"]
    # The compiler's own figure: its peak where libtpu gives one, else the total of its memory-usage report (the
    # figure its out-of-memory refusal names); only where neither is there (a trace compiled before the report was
    # read) the sum of get_compiled_memory_stats' buffers, which counts more than the compiler does: gpt2-xl with
    # fsdp on v5e-8 summed 17.2 GiB, its report 14.9 GiB, and it compiled.
    peak = memory.get("peak") or memory.get("compiler_total") or (
        memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temps"] + memory["code"])
    hbm = gen.hbm_gib_per_device * 2**30
    groups: dict[str, dict] = {}
    for c in cost.collectives:
        where = "inside" if c.in_loop else "outside"
        group = groups.setdefault(f"{c.kind} {where}", {"kind": c.kind, "where": where, "count": 0, "bytes": 0})
        group["count"] += 1
        group["bytes"] += c.bytes
    collective_s = sum(collective_seconds(c, compiled["devices"], target["ici_bw"]) * c.runs for c in cost.collectives)
    model_flops = train.model.shape.flops_per_token() * train.step.total_batch_tokens / compiled["devices"]
    # The Pallas kernels (flash attention) are opaque to the HLO: their FLOPs are taken as attention's 12LCT of the
    # model's (the scores and values matmuls, none of which the HLO then holds), at peak, or their bytes at HBM
    # bandwidth, whichever is longer.
    attention_flops = 12 * train.model.shape.n_layer * train.model.shape.n_embd * train.model.shape.block_size
    kernel_flops = attention_flops * train.step.total_batch_tokens / compiled["devices"] if cost.kernel_calls else 0.0
    kernel_s = kernel_seconds(kernel_flops, cost.kernel_bytes, gen.peak_bf16_per_chip, target["hbm_bw"])
    step_s = cost.roofline_ops_s + kernel_s + collective_s
    # And with their matmuls filling only the head dim's share of the MXU (scripts/hlo_cost.py mxu_efficiency).
    head_dim = train.model.shape.n_embd // train.model.shape.n_head
    efficiency = mxu_efficiency(head_dim, MXU_WIDTH[target["generation"]])
    kernel_mxu_s = kernel_seconds(kernel_flops, cost.kernel_bytes, gen.peak_bf16_per_chip, target["hbm_bw"],
                                  efficiency)
    step_mxu_s = step_s - kernel_s + kernel_mxu_s
    return {**head, "memory": memory, "peak_bytes": peak,
            "hbm_bytes": hbm, "fits": peak <= hbm, "free_fraction": 1 - peak / hbm,
            "flops": cost.flops, "model_flops": model_flops, "hbm_traffic": cost.hbm_bytes,
            "loops": list(cost.loops.values()), "collectives": list(groups.values()),
            "roofline_ops_s": cost.roofline_ops_s, "collective_s": collective_s, "step_s": step_s,
            "kernel_calls": cost.kernel_calls, "kernel_flops": kernel_flops, "kernel_bytes": cost.kernel_bytes,
            "kernel_s": kernel_s,
            "mfu_ceiling": model_flops / (gen.peak_bf16_per_chip * step_s) if step_s else 0.0,
            "head_dim": head_dim, "mxu_width": MXU_WIDTH[target["generation"]], "mxu_efficiency": efficiency,
            "kernel_mxu_s": kernel_mxu_s, "step_mxu_s": step_mxu_s,
            "mfu_ceiling_mxu": model_flops / (gen.peak_bf16_per_chip * step_mxu_s) if step_mxu_s else 0.0}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def report_lines(r: dict) -> list[str]:
    """The report as lines; the HBM, collective and MFU lines keep one fixed form for scripts that read them."""
    free = r["free_fraction"]
    verdict = (f"fits, {free:.0%} free" + (" - tight" if free < TIGHT_FREE_FRACTION else "")) if r["fits"] else \
        f"does not fit, {_gib(r['peak_bytes'] - r['hbm_bytes'])} over"
    lines = [f"{r['tpu']} ({r['device_kind']} x{r['devices']}; jax {r['versions']['jax']}, libtpu "
             f"{r['versions']['libtpu']}): {r['preset']}, micro-batch {r['micro_batch']} x {r['grad_accum_steps']} "
             f"micro-steps, {r['attention']} attention, activation checkpointing "
             f"{'on' if r['activation_checkpointing'] else 'off'}, scan {'on' if r['scan_layers'] else 'off'}, fsdp "
             f"{'on' if r['fsdp'] else 'off'}; compiled in {r['compile_s']:.0f} s"
             + (" (cached)" if r.get("cached") else ""),
             f"HBM per chip: {r['peak_bytes'] / 2**30:.1f} GiB of {r['hbm_bytes'] / 2**30:.0f} GiB ({verdict})"]
    if "compiler_says" in r:
        return lines + [f"  the compiler refused the step: {r['compiler_says']}"]
    m = r["memory"]
    peak = f"; its peak {_gib(m['peak'])}" if m.get("peak") else \
        f"; its memory-usage report's total {_gib(m['compiler_total'])}" if m.get("compiler_total") else \
        "; no peak reported: their sum stands for it"
    lines += [f"  compiler's buffers: arguments {_gib(m['arguments'])}, outputs {_gib(m['outputs'])} (aliased to "
              f"arguments {_gib(m['aliased'])}), temps {_gib(m['temps'])}, code {_gib(m['code'])}{peak}"]
    for where in ("inside", "outside"):
        unit = "per micro-step" if where == "inside" else "per step"
        found = [g for g in r["collectives"] if g["where"] == where]
        if not any(g["kind"] == "all-reduce" for g in found):
            found.append({"kind": "all-reduce", "count": 0, "bytes": 0})
        for g in found:
            lines.append(f"{g['kind']} {where} the loop: {g['count']}, {g['bytes'] / 1e6:.1f} MB {unit}")
    lines += [f"step FLOPs per chip (estimate from the optimized HLO, loops' trip counts applied): "
              f"{r['flops'] / 1e12:.2f} TFLOP ({r['model_flops'] / 1e12:.2f} TFLOP of model FLOPs, 6N + 12LCT); "
              f"HBM traffic {r['hbm_traffic'] / 1e9:.2f} GB",
              f"roofline lower bound (estimate): {r['step_s'] * 1e3:.1f} ms a step = ops "
              f"{r['roofline_ops_s'] * 1e3:.1f} ms (each op at peak FLOP/s or HBM bandwidth) + "
              + (f"Pallas kernels {r['kernel_s'] * 1e3:.1f} ms ({r['kernel_calls']} calls, opaque to the HLO: the "
                 f"attention's {r['kernel_flops'] / 1e12:.2f} TFLOP of 12LCT at peak) + "
                 if r.get("kernel_calls") else "")
              + f"collectives {r['collective_s'] * 1e3:.1f} ms (at ICI bandwidth)",
              f"MFU ceiling: {r['mfu_ceiling']:.1%}"]
    return lines + mxu_lines(r)
