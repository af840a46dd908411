"""Tokens/s and MFU of a preset (default gpt2, 124M, at T=1024) on this device: the project's trainer
(`shared.train.trainer.train`, read back from its metrics.jsonl) side by side with a plain PyTorch reference loop
of the same model in the same run (eager, torch.optim.AdamW defaults, same micro-batch per device).

    python scripts/bench_mfu.py                      # auto: CUDA if present, else a TPU, else the CPU
    python scripts/bench_mfu.py --backend cpu        # small defaults: 1 sequence, 3 steps (figures only)
    torchrun --nproc-per-node 8 scripts/bench_mfu.py # the trainer under DDP; the reference on one GPU

MFU = tokens/s x FLOPs per token / bf16 peak FLOP/s, with FLOPs per token = 6 N + 12 n_layer n_embd T
(nanoGPT / PaLM appendix B: forward + backward of the weights' matmuls, plus attention's QK^T and AV),
N counted as the trainer counts it (every parameter, the tied embedding once), peaks from
shared.runtime.runtime.PEAK_BF16_FLOPS.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shared.errors import UserError, run_cli  # noqa: E402
from shared.train_sections import ATTENTION_SETTINGS  # noqa: E402

CPU_NOTICE = "MFU is meaningless on CPU; figures only show the script runs"


def flops_per_token(num_params: int, n_layer: int, n_embd: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 N (forward 2N + backward 4N) + 12 L C T (attention scores and values)."""
    return 6 * num_params + 12 * n_layer * n_embd * seq_len


def tpu_present() -> bool:
    return (os.environ.get("PJRT_DEVICE", "").upper() == "TPU" or os.path.exists("/dev/accel0")
            or os.path.exists("/dev/vfio/0"))


def pick_backend(requested: str) -> str:
    """auto: a GPU, else a TPU, else the plain CPU (torch_xla's CPU devices only when asked for: --backend xla)."""
    import torch

    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        return "cuda"
    return "xla" if tpu_present() else "cpu"


CHAIN_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "chain-gpt2-124m.json"


def chain_step(devices: int, seq_len: int, generation: str | None = None,
               attention: str | None = None) -> tuple[int, int]:
    """(micro-batch per device, accumulation) of the gpt2 chain config (examples/chain-gpt2-124m.json): what a
    real session runs (`auto` as the session would choose it on TPU `generation`, with the first attention kernel
    it tries there for the `attention` setting, default the config's, passing its probe: shared/model/attention.py)."""

    from shared.config import AUTO, TrainConfig
    from shared.model.attention import candidates
    from shared.tpu import micro_batch_for

    train = chain_train_settings()
    kept = {k: v for k, v in train.items() if k in ("micro_batch", "total_batch_tokens", "attention")}
    cfg = TrainConfig.from_dict({**kept, **({"attention": attention} if attention else {}), "preset": "gpt2",
                                 "seq_len": seq_len})
    if cfg.step.micro_batch == AUTO:
        first = candidates(generation, seq_len, cfg.step.attention)[0]
        cfg = cfg.replace(micro_batch=micro_batch_for(cfg, generation, first, devices))
    return max(1, cfg.step.micro_batch // devices), cfg.grad_accum_steps


def chain_train_settings() -> dict:
    """The gpt2 chain config's train settings, flat, as the chain reads them (whichever shape the file writes)."""
    from scripts.chain.config import load_config

    return load_config(CHAIN_CONFIG).train.settings


def default_settings(backend: str, on_tpu: bool, devices: int, seq_len: int, generation: str | None = None,
                     attention: str | None = None) -> tuple[int, int, int, int, str]:
    """(micro-batch per device, accumulation, measured steps, warm-up steps, why) when the flags leave them
    unset (`attention`: the setting, as chain_step takes it). Measured and warm-up steps are multiples of the log
    interval (10), as in a real session."""
    import torch

    if backend == "cuda":
        gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        micro = 32 if gib >= 60 else 16 if gib >= 30 else 8
        return micro, 1, 20, 10, f"CUDA defaults for {gib:.0f} GiB: micro-batch {micro}, 20 steps after 10 warm-up"
    if backend == "xla" and on_tpu:
        micro, accum = chain_step(devices, seq_len, generation, attention)
        return micro, accum, 20, 10, (f"TPU defaults: the gpt2 chain's step ({CHAIN_CONFIG.name}): micro-batch "
                                      f"{micro} per device x {accum} micro-steps, 20 steps after 10 warm-up")
    if backend == "xla":  # torch_xla's CPU devices: steps 1 and 2 compile
        return 1, 2, 10, 10, ("XLA CPU-device defaults: micro-batch 1 per device x 2 micro-steps, 10 steps after "
                              "10 warm-up (figures only)")
    # torch on the CPU: just enough to show the script runs.
    return 1, 1, 3, 1, "CPU defaults: micro-batch 1 per device, 3 steps after 1 warm-up, to finish in minutes"


def write_random_shards(data_dir: Path, tokens_needed: int, vocab: int, seed: int = 0) -> None:
    """Two llm.c train shards of uniformly random tokens (the loader wraps around, so a few batches suffice)."""
    import numpy as np

    from shared.data import write_shard

    data_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(2):
        write_shard(data_dir / f"random_train_{i:06d}.bin", rng.integers(0, vocab, tokens_needed, dtype=np.int64))


def trainer_throughput(records: list[dict], warmup: int) -> tuple[float, float, int]:
    """(tokens/s, mean step seconds, steps measured) from the trainer's metrics.jsonl, warm-up excluded. Each
    logged record covers the steps since the previous one, its window closed once the device had finished
    them (the logged loss is read first), so a window's tokens/s is real device throughput."""
    logged = [r for r in records if "loss" in r and r.get("tokens_per_s")]
    steps = [r for r in logged if r["step"] > warmup]
    if not steps:
        raise UserError("the trainer logged no step after the warm-up; raise --steps")
    tokens = records_tokens_per_step(records)
    previous = {b["step"]: a["step"] for a, b in zip(logged, logged[1:], strict=False)}
    counts = [r["step"] - previous.get(r["step"], warmup) for r in steps]
    seconds = [n * tokens / r["tokens_per_s"] for n, r in zip(counts, steps, strict=True)]
    return tokens * sum(counts) / sum(seconds), sum(seconds) / sum(counts), sum(counts)


def trainer_step_counts(records: list[dict], warmup: int) -> dict[str, float]:
    """Per measured step, from what the trainer logged (0 on CUDA/CPU, where nothing is counted): XLA compilations
    (total), graphs executed, device-to-host transfers, explicit device waits (counted by wrapping torch_xla's
    wait), and the timing means: host_trace_ms (the host building a step before its sync), sync_ms (the sync:
    waiting for the previous step, hashing, launching), device_ms (graphs running on the device) and device_busy
    (device time over wall time)."""
    logged = {r["step"]: r for r in records if "loss" in r}
    counts = {"compiles": 0, "graphs": 0.0, "d2h": 0.0, "device_waits": 0.0, "host_trace_ms": 0.0,
              "device_ms": 0.0, "sync_ms": 0.0, "device_busy": 0.0}
    if warmup not in logged:
        return counts
    first, last = logged[warmup], logged[max(logged)]
    steps = max(1, last["step"] - first["step"])
    counts.update(compiles=(last.get("compiles") or 0) - (first.get("compiles") or 0),
                  graphs=((last.get("graphs") or 0) - (first.get("graphs") or 0)) / steps,
                  d2h=((last.get("d2h_transfers") or 0) - (first.get("d2h_transfers") or 0)) / steps)
    order = sorted(logged)
    windows = [(b - a, logged[b]) for a, b in zip(order, order[1:], strict=False) if b > warmup]
    for key in ("device_waits", "host_trace_ms", "device_ms", "sync_ms"):
        counts[key] = sum(n * (r.get(key) or 0) for n, r in windows) / steps
    tokens = records_tokens_per_step(records)
    seconds = sum(n * tokens / r["tokens_per_s"] for n, r in windows if r.get("tokens_per_s"))
    counts["device_busy"] = min(1.0, counts["device_ms"] * steps / 1e3 / seconds) if seconds else 0.0
    return counts


def records_tokens_per_step(records: list[dict]) -> int:
    logged = [r for r in records if "loss" in r]
    return logged[0]["tokens"] // logged[0]["step"]


def sync_device(runtime) -> None:
    """Wait until the device has finished everything queued (timing needs it: CUDA and XLA run ahead)."""
    import torch

    if runtime.device.type == "cuda":
        torch.cuda.synchronize(runtime.device)
    elif runtime.name == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()


def reference_loop(model_cfg, runtime, micro: int, warmup: int, steps: int,
                   seed: int = 0) -> tuple[list[float], int]:
    """A plain PyTorch training loop: eager (no torch.compile), torch.optim.AdamW defaults (foreach on CUDA),
    SDPA attention, autocast in the device's AMP dtype (bf16; fp16 + GradScaler on GPUs without bf16), grad
    clip 1.0. One device: under XLA SPMD its tensors carry no sharding (every device runs the whole step).
    Returns the seconds of each step after the warm-up, each ended by a device synchronisation, and the XLA
    compilations during those steps (0 where nothing recompiles)."""
    import numpy as np
    import torch

    from shared.model.model import GPT
    from shared.model_shape import GPT2_VOCAB_SIZE

    torch.manual_seed(seed)
    model = GPT(model_cfg).to(runtime.device)  # SDPA: the runtime's kernel is the trainer's model's alone
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1)
    scaler = torch.amp.GradScaler("cuda", enabled=runtime.device.type == "cuda"
                                  and runtime.amp_dtype == torch.float16)
    xla = runtime.name == "xla"
    if xla:
        import torch_xla
    rng = np.random.default_rng(seed)
    vocab = min(model_cfg.vocab_size, GPT2_VOCAB_SIZE)
    batch = rng.integers(0, vocab, (micro, model_cfg.block_size + 1)).astype(np.int32)
    times, compiles = [], None
    sync_device(runtime)
    try:
        for i in range(warmup + steps):
            start = time.perf_counter()
            x = torch.from_numpy(batch).to(runtime.device)  # a host-to-device batch per step, as the trainer does
            with torch.autocast(runtime.device.type, dtype=runtime.amp_dtype):
                _, loss = model(x[:, :-1], x[:, 1:])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            if xla:
                torch_xla.sync()  # cut the lazy graph at the step boundary, as any torch_xla loop must
            sync_device(runtime)
            if i >= warmup:
                times.append(time.perf_counter() - start)
            if i + 1 == warmup:
                compiles = runtime.compile_count()
    finally:
        del model, opt
    return times, runtime.compile_count() - compiles if compiles is not None else 0


def release_memory(runtime) -> None:
    import torch

    gc.collect()
    if runtime.device.type == "cuda":
        torch._dynamo.reset()  # compiled graphs hold the trainer's model
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(runtime.device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (default 1024)")
    parser.add_argument("--micro-batch", type=int, default=0,
                        help="sequences per device per step (default: by device; 1 on CPU)")
    parser.add_argument("--accum", type=int, default=0,
                        help="micro-steps per optimizer step (default: by device; the gpt2 chain's on a TPU)")
    parser.add_argument("--log-every", type=int, default=10, help="the trainer's log interval (default 10, as a "
                        "session logs; measured and warm-up steps are rounded up to multiples of it)")
    parser.add_argument("--steps", type=int, default=0, help="measured steps per path (default: by device)")
    parser.add_argument("--warmup", type=int, default=-1,
                        help="steps run first and excluded (compilation; default: by device)")
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "cpu", "xla"],
                        help="auto: CUDA if present, else a TPU (xla), else the CPU")
    parser.add_argument("--skip-reference", action="store_true", help="measure the trainer only")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "muon"],
                        help="the trainer's optimizer (default adamw; the reference loop always runs torch's AdamW)")
    parser.add_argument("--attention", choices=ATTENTION_SETTINGS,
                        help="the trainer's attention setting (default: the gpt2 chain config's, else auto: the "
                        "first kernel a session tries; shared/model/attention.py); the reference loop runs SDPA")
    args = parser.parse_args()

    backend = pick_backend(args.backend)
    if backend == "xla":
        from shared.tpu import default_xla_env

        default_xla_env()  # torch_xla's CPU devices off-TPU; must precede torch's first backward pass
    import torch

    from shared.config import TrainConfig
    from shared.model.model import GPT
    from shared.model_shape import GPT2_VOCAB_SIZE
    from shared.runtime.device import make_runtime
    from shared.train.metrics import read_metrics
    from shared.train.trainer import train

    if backend == "cuda" and not torch.cuda.is_available():
        raise UserError("--backend cuda: no CUDA device found")
    runtime = make_runtime(backend)
    on_tpu = runtime.name == "xla" and runtime._xr.device_type() == "TPU"
    attention = args.attention or chain_train_settings().get("attention", "auto")
    micro_d, accum_d, steps_d, warmup_d, why = default_settings(backend, on_tpu, runtime.num_devices, args.seq_len,
                                                                runtime.tpu_generation and runtime.tpu_generation.name,
                                                                attention)
    micro = args.micro_batch or micro_d
    accum = args.accum or accum_d
    log_every = max(1, args.log_every)
    steps = -(-(args.steps or steps_d) // log_every) * log_every
    warmup = -(-(warmup_d if args.warmup < 0 else args.warmup) // log_every) * log_every
    defaults_used = not (args.micro_batch and args.accum and args.steps and args.warmup >= 0)
    n_dev = runtime.num_devices
    ddp = runtime.name == "ddp"
    say = print if runtime.is_main else (lambda *a, **k: None)

    cfg_probe = TrainConfig.from_dict(dict(preset=args.preset, seq_len=args.seq_len))
    model_cfg = cfg_probe.model.shape
    num_params = GPT(model_cfg).num_params()
    fpt = flops_per_token(num_params, model_cfg.n_layer, model_cfg.n_embd, model_cfg.block_size)
    peak_all = runtime.peak_flops()
    peak_one = peak_all / n_dev if peak_all else None
    name = (torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda"
            else runtime.description)

    say(f"device: {runtime.description}{f' ({name})' if name != runtime.description else ''}; bf16 peak "
        + (f"{peak_one / 1e12:.1f} TFLOP/s per device (shared.runtime.runtime.PEAK_BF16_FLOPS)" if peak_one
           else "unknown"))
    say(f"model: {args.preset} ({num_params / 1e6:.2f}M params), T={model_cfg.block_size}, micro-batch {micro} "
        f"per device x {accum} micro-steps per optimizer step; FLOPs/token = 6N + 12*L*C*T = 6*{num_params:,} + "
        f"12*{model_cfg.n_layer}*{model_cfg.n_embd}"
        f"*{model_cfg.block_size} = {fpt:,} ({fpt / 1e9:.3f} GFLOP)")
    if defaults_used:
        say(f"settings: {why} (the flags --micro-batch/--accum/--steps/--warmup override these)")
    say(f"measuring {steps} steps per path after {warmup} warm-up steps (excluded: compilation, allocator); the "
        f"trainer logs every {log_every} steps")
    on_cpu = runtime.device.type == "cpu" or (runtime.name == "xla" and not on_tpu)
    no_peak = CPU_NOTICE if on_cpu else f"no known bf16 peak for {name}: MFU not computed (see PEAK_BF16_FLOPS)"
    if not peak_one:
        say(no_peak)
    if ddp:
        kind = "GPUs" if runtime.device.type == "cuda" else "CPU processes"
        say(f"torchrun: the project's trainer runs DDP over {n_dev} {kind} (tokens/s and MFU over all of them); "
            f"the reference loop is single-device (each process runs its own; rank 0's figures shown)")
    if runtime.name == "xla" and n_dev > 1:
        say(f"XLA SPMD: the trainer shards the batch over {n_dev} devices (micro-batch {micro * n_dev} in all); "
            f"the reference loop's tensors are unsharded, i.e. one device's work (MFU over one device's peak)")

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-mfu-") as tmp:
        global_micro = micro * n_dev
        tokens_per_micro_step = global_micro * model_cfg.block_size
        # Every process (DDP) writes the same shards into its own folder; the loader wraps around them.
        write_random_shards(Path(tmp) / "data", 4 * tokens_per_micro_step + 1,
                            min(model_cfg.vocab_size, GPT2_VOCAB_SIZE))
        cfg = TrainConfig.from_dict(dict(
            preset=args.preset, seq_len=args.seq_len, data_dir=f"{tmp}/data", out_dir=f"{tmp}/run",
            micro_batch=global_micro, total_batch_tokens=tokens_per_micro_step * accum,
            total_steps=warmup + steps, warmup_steps=max(1, warmup + steps), log_every=log_every,
            eval_every=0, checkpoint_every=0, keep_checkpoints=1, progress=False, wandb_project="",
            xla_cache=False, backend=backend, optimizer=args.optimizer, attention=attention))
        train(cfg, runtime, log=lambda msg, *a, **k: say(f"  [trainer] {msg}", flush=True))
        peak_mem = (torch.cuda.max_memory_allocated(runtime.device) / 2**30
                    if runtime.device.type == "cuda" else None)
        if runtime.is_main:
            records = read_metrics(f"{tmp}/run/metrics.jsonl")
            tok_s, step_s, measured = trainer_throughput(records, warmup)
            counts = trainer_step_counts(records, warmup)
            end = next((r for r in records if r.get("event") == "session_end"), {})
            counts["compile_s"], counts["session_compiles"] = end.get("compile_s"), end.get("compiles")
            if counts["compiles"]:
                say(f"note: the trainer compiled {counts['compiles']} XLA graphs during its measured steps; "
                    f"raise --warmup")
            how = {"cuda": "torch.compile, fused AdamW", "xla": "XLA graphs"}.get(
                "xla" if runtime.name == "xla" else runtime.device.type, "eager")
            label = f"project trainer ({f'DDP x{n_dev}, ' if ddp else f'SPMD x{n_dev}, ' if n_dev > 1 else ''}{how})"
            rows.append((label, tok_s, peak_all, step_s, measured, peak_mem))
    release_memory(runtime)

    if not args.skip_reference:
        try:
            times, recompiles = reference_loop(model_cfg, runtime, micro, warmup, steps)
        except RuntimeError as err:  # CUDA OOM, XLA RESOURCE_EXHAUSTED: the trainer's figures still stand
            if "out of memory" not in str(err).lower() and "RESOURCE_EXHAUSTED" not in str(err):
                raise
            say(f"note: the reference loop ran out of device memory at micro-batch {micro} "
                f"({str(err).splitlines()[0][:160]}); rerun with a smaller --micro-batch to compare")
            times, recompiles = [], 0
            release_memory(runtime)
        if recompiles:
            say(f"note: the reference compiled {recompiles} XLA graphs during its measured steps; raise --warmup")
        peak_mem = (torch.cuda.max_memory_allocated(runtime.device) / 2**30
                    if runtime.device.type == "cuda" else None)
        ref = "plain PyTorch/XLA reference (unsharded" if runtime.name == "xla" else "plain PyTorch reference (eager"
        if times:
            step_s = sum(times) / len(times)
            rows.append((f"{ref}, AdamW defaults)", micro * model_cfg.block_size / step_s,
                         peak_one, step_s, len(times), peak_mem))
    if ddp:
        runtime.barrier()

    if runtime.is_main:
        say("")
        say(f"{'path':<58} {'tokens/s':>12} {'MFU':>7} {'step time':>10} {'steps':>5}"
            + ("  peak mem" if peak_mem else ""))
        for label, tok_s, peak, step_s, measured, mem in rows:
            mfu = f"{100 * tok_s * fpt / peak:6.1f}%" if peak else "    n/a"
            say(f"{label:<58} {tok_s:>12,.0f} {mfu:>7} {step_s * 1e3:>8.0f}ms {measured:>5}"
                + (f"  {mem:6.1f} GiB" if mem else ""))
        if rows and rows[0][0].startswith("project trainer"):
            say(f"trainer per optimizer step ({accum} micro-steps): {counts['graphs']:.2f} graphs executed, "
                f"{counts['device_waits']:.2f} device waits, {counts['d2h']:.2f} device-to-host transfers, "
                f"{counts['compiles']} compilations during the {measured} measured steps")
            say(f"trainer timing per step: host trace {counts['host_trace_ms']:.1f} ms, device execute "
                f"{counts['device_ms']:.1f} ms, sync (waiting for the previous step, launching) "
                f"{counts['sync_ms']:.1f} ms; device busy {100 * counts['device_busy']:.1f}% of wall time")
            say(f"trainer compilation over the session: {counts['compile_s']} s for {counts['session_compiles']} "
                f"graphs (session_end)")
        if len(rows) == 2:
            say(f"trainer / reference tokens/s: {rows[0][1] / rows[1][1]:.2f}x"
                + (f" (trainer on {n_dev} devices, reference on 1)" if n_dev > 1 else ""))
        if not peak_one:
            say(no_peak)
        say("json: " + json.dumps({"device": name, "preset": args.preset, "seq_len": model_cfg.block_size,
                                   "micro_batch_per_device": micro, "accum": accum, "devices": n_dev,
                                   "flops_per_token": fpt, "steps": steps, "warmup": warmup, "log_every": log_every,
                                   "trainer_per_step": counts if rows else None,
                                   "rows": [{"path": r[0], "tokens_per_s": round(r[1], 1),
                                             "mfu": round(r[1] * fpt / r[2], 4) if r[2] else None,
                                             "step_s": round(r[3], 4)} for r in rows]}))
    if ddp:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    run_cli(main)
