"""The shipped one-session recipe against one change at a time, on a GPT-2-shaped model (GELU, LayerNorm with gains,
biases, learned positions, tied head: the project's own model, trained by its own trainer) on real text, several
paired seeds, long enough to get well below the first plateau.

    python scripts/bench_recipe_arms.py                 # 7 arms x 4 seeds, 500 steps each (docs/recipe.md 4b)
    python scripts/bench_recipe_arms.py --seeds 6 --steps 800

A seed sets the initialisation and the data: each seed reads a window of the corpus's training tokens of its own
(no token read by two seeds), and every arm of a seed reads the same window from the same start. So seeds differ
as two real runs would, and the difference between an arm and `shipped` is paired seed by seed.

The arms, each the shipped settings (examples/chain-gpt2-124m-muon.json's optimizer and schedule, read from the
file, so the bench runs what ships) with one change:

- `shipped`: as shipped (the example's settings as the file has them now; docs/recipe.md section 1 gives each
  one and its source).
- `aux-lr-6e-4` (or `aux-lr-at-lr` where the example sets `aux_lr`): the position embeddings, biases and gains at
  build-nanogpt's 6e-4 (or back at `lr`, the record's one AdamW rate); the token embedding (so the tied head) keeps
  the shipped LR.
- `warmup`: a linear warm-up over build-nanogpt's share of the run (715 of 19,073 steps).
- `muon-decay`: Muon's matrices decay as Moonlight's do, at its strength per step (lambda 0.1 at its LR, whose
  steps have RMS 0.2 x LR: 0.5 in this project's `max_dim` convention at the shipped Muon LR).
- `attn-scale`: every attention output multiplied by 1/sqrt(2 x n_layer), as the record's blocks do (1/sqrt(24) at 12
  layers). A scaled initialisation would not do it: Muon's steps have a fixed size whatever the weights' scale.
- `clip` (or `no-clip` where the example clips): the gradient's global norm clipped at 1.0 (or not at all).
- `adamw-build-nanogpt`: no Muon: AdamW at build-nanogpt's settings (6e-4 everywhere, decay 0.1 on matrices, clip
  1.0, that warm-up, cosine to 10%).

Each run checkpoints at every eval; the bench reads the RMS of every block matrix from them (weight_rms.json per run)
and deletes them. Output: a table (final val loss, mean ± sd; each arm minus `shipped`, its mean with a paired 95%
interval, whether that interval leaves out zero, and each seed's difference), the val loss curves and the weight RMS
per layer over the run as PNGs, in --out-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_recipe import add_bench_args, plot_curves, prepare_bench, run, spread  # noqa: E402
from shared.errors import UserError, run_cli  # noqa: E402

SHIPPED_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "chain-gpt2-124m-muon.json"
BUILD_NANOGPT_LR = 6e-4
BUILD_NANOGPT_WARMUP_SHARE = 715 / 19_073
# Moonlight: W -= eta (0.2 sqrt(max dim) O + 0.1 W). Ours (max_dim): W -= muon_lr (sqrt(max dim) O + wd W), so
# muon_lr = 0.2 eta and wd = 0.1 eta / muon_lr = 0.5, whatever the LR.
MOONLIGHT_DECAY = 0.5


def shipped_settings(path: Path = SHIPPED_EXAMPLE) -> dict:
    """The optimizer and schedule settings the shipped example gives its train kernel, with the trainer's defaults
    for the ones it leaves out (so a key added to the example is benched as shipped)."""
    from shared.config import TrainConfig
    from shared.train_sections import flatten_sections

    train = flatten_sections(json.loads(path.read_text())["train"], f"{path}: train")
    defaults = TrainConfig()
    # The optimizer's and the schedule's sections, whole, but the run's own length (the bench's --steps) and --extend
    return {key: train.get(key, default) for section in (defaults.optim, defaults.lr_schedule)
            for key, default in dataclasses.asdict(section).items() if key not in ("total_steps", "extend")}


def recipe_arms(shipped: dict, steps: int, n_layer: int) -> dict[str, tuple[dict, float]]:
    """Each arm's settings and its attention-output multiplier (1.0: none), keyed by the run folders' names."""
    warmup = max(1, round(steps * BUILD_NANOGPT_WARMUP_SHARE))
    # The clip's and the aux rate's arms take the other side of the example's choice.
    clip_arm = "no-clip" if shipped["grad_clip"] else "clip"
    aux_arm, aux_lr = ("aux-lr-at-lr", 0.0) if shipped["aux_lr"] else ("aux-lr-6e-4", BUILD_NANOGPT_LR)
    adamw = {**shipped, "optimizer": "adamw", "lr": BUILD_NANOGPT_LR, "aux_lr": 0.0, "matrix_lr": 0.0,
             "weight_decay": 0.1, "grad_clip": 1.0, "schedule": "cosine", "warmup_steps": warmup, "min_lr_ratio": 0.1}
    return {
        "shipped": (shipped, 1.0),
        aux_arm: ({**shipped, "aux_lr": aux_lr}, 1.0),  # `lr` is the tied embedding's: kept
        "warmup": ({**shipped, "warmup_steps": warmup}, 1.0),
        "muon-decay": ({**shipped, "muon_weight_decay": MOONLIGHT_DECAY}, 1.0),
        "attn-scale": (shipped, (2 * n_layer) ** -0.5),
        clip_arm: ({**shipped, "grad_clip": 0.0 if shipped["grad_clip"] else 1.0}, 1.0),
        "adamw-build-nanogpt": (adamw, 1.0),
    }


def seed_data_dirs(data_dir: Path, out_root: Path, seeds: int, tokens: int) -> list[Path]:
    """A data folder per seed: one training shard holding the seed's own window of `tokens` training tokens (the
    corpus's shards read end to end; no token in two windows), beside links to the corpus's validation shards,
    which every seed shares. Written once, kept beside the runs."""
    import numpy as np

    from shared.data import find_shards, read_shard, write_shard

    train = np.concatenate([read_shard(path) for path in find_shards(str(data_dir), "train")])
    if seeds * tokens > train.size:
        raise UserError(f"{seeds} seeds x {tokens:,} tokens each is more than the corpus's {train.size:,} training "
                        "tokens: fewer --seeds, --steps or --batch-tokens")
    folders = []
    for index in range(seeds):
        folder = out_root / "data" / f"window{index}-of-{tokens}"
        shard = folder / "bench_train_000000.bin"
        if not shard.exists():
            folder.mkdir(parents=True, exist_ok=True)
            for val in find_shards(str(data_dir), "val"):
                (folder / val.name).unlink(missing_ok=True)
                (folder / val.name).symlink_to(val.resolve())
            write_shard(shard, train[index * tokens:(index + 1) * tokens])
        folders.append(folder)
    return folders


def t_quantile_975(df: int) -> float:
    """Student's t at 0.975 with `df` degrees of freedom (a two-sided 95% interval's multiplier): its CDF, the
    density integrated by Simpson's rule, solved by bisection."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float, n: int = 4000) -> float:
        h = x / n
        density = [math.exp(log_norm - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(n + 1)]
        return 0.5 + h / 3 * (density[0] + density[-1] + 4 * sum(density[1:-1:2]) + 2 * sum(density[2:-1:2]))

    low, high = 0.0, 100.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < 0.975 else (low, mid)
    return (low + high) / 2


def paired_interval(diffs: list[float]) -> tuple[float, float]:
    """The mean of per-seed differences and the half-width of its 95% interval (t with n - 1 degrees of freedom);
    inf where one seed gives no spread to measure."""
    mean = statistics.mean(diffs)
    if len(diffs) < 2:
        return mean, math.inf
    return mean, t_quantile_975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))


@contextlib.contextmanager
def attention_output_scaled(scale: float):
    """Every CausalSelfAttention's output multiplied by scale while inside (this process only)."""
    from shared.model.model import CausalSelfAttention

    if scale == 1.0:
        yield
        return
    original = CausalSelfAttention.forward
    CausalSelfAttention.forward = lambda self, x: original(self, x) * scale
    try:
        yield
    finally:
        CausalSelfAttention.forward = original


def block_matrix_rms(model_file: Path) -> dict[str, float]:
    """The RMS of every transformer block's matrix in a checkpoint's model.safetensors, by parameter name."""
    from safetensors.torch import load_file

    tensors = load_file(str(model_file))
    return {name: float(t.float().pow(2).mean().sqrt()) for name, t in sorted(tensors.items())
            if t.dim() == 2 and ".h." in f".{name}"}


def weight_rms_trace(out: Path) -> list[dict]:
    """[{step, rms: {name: value}}] from a finished run's checkpoints (kept in weight_rms.json; the checkpoints are
    deleted once read)."""
    from shared.checkpoint_names import MODEL_FILE
    from shared.train.checkpoint import _step_of, list_checkpoints

    trace_file = out / "weight_rms.json"
    if trace_file.exists():
        return json.loads(trace_file.read_text())
    checkpoints = out / "checkpoints"
    trace = [{"step": _step_of(path), "rms": block_matrix_rms(path / MODEL_FILE)}
             for path in list_checkpoints(checkpoints)]
    if not trace:
        raise UserError(f"{out}: no checkpoints to read the weight RMS from")
    trace_file.write_text(json.dumps(trace))
    shutil.rmtree(checkpoints)
    return trace


def layer_kind(name: str) -> tuple[int, str]:
    """('transformer.h.3.attn.c_proj.weight') -> (3, 'attn.c_proj')."""
    parts = name.split(".")
    index = parts.index("h") + 1
    return int(parts[index]), ".".join(parts[index + 1:-1])


def plot_weight_rms(traces: dict[str, list[dict]], path: Path, title: str) -> Path:
    """One panel per matrix kind (attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj), the RMS over steps of each
    arm, the mean over layers solid and the layers' min to max as a band (the first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({layer_kind(name)[1] for name in next(iter(traces.values()))[0]["rms"]})
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 4), dpi=100, sharex=True)
    for ax, kind in zip(axes, kinds, strict=True):
        for arm, trace in traces.items():
            steps = [point["step"] for point in trace]
            per_step = [[v for n, v in point["rms"].items() if layer_kind(n)[1] == kind] for point in trace]
            line, = ax.plot(steps, [statistics.mean(v) for v in per_step], label=arm,
                            linestyle="--" if arm.startswith("adamw") else "-")
            ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step], alpha=0.15,
                            color=line.get_color())
        ax.set(title=kind, xlabel="step", ylabel="weight RMS")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def final_rms_by_kind(trace: list[dict]) -> dict[str, float]:
    """The last checkpoint's RMS per matrix kind, averaged over layers."""
    by_kind: dict[str, list[float]] = {}
    for name, value in trace[-1]["rms"].items():
        by_kind.setdefault(layer_kind(name)[1], []).append(value)
    return {kind: statistics.mean(values) for kind, values in sorted(by_kind.items())}


def report(finals: dict[str, list[float]], rms: dict[str, dict[str, float]], seeds: int) -> str:
    """The table: each arm's final val loss; its difference from `shipped`, paired seed by seed, as a mean with its
    95% interval and whether that interval leaves out zero; each seed's difference; and its block matrices' final
    RMS per kind (the first seed)."""
    shipped = finals["shipped"]
    kinds = list(next(iter(rms.values())))
    lines = [f"| arm | final val loss: mean ± sd (min–max), {seeds} seeds | minus shipped's: mean ± 95% interval "
             "(paired) | significant | per seed | " + " | ".join(f"{k} RMS" for k in kinds) + " |",
             "| --- | --- | --- | --- | --- |" + " --- |" * len(kinds)]
    for arm, values in finals.items():
        if arm == "shipped":
            paired, verdict, per_seed = "—", "—", "—"
        else:
            diffs = [v - s for v, s in zip(values, shipped, strict=True)]
            mean, half = paired_interval(diffs)
            paired = f"{mean:+.4f} ± {half:.4f}"
            verdict = ("no" if abs(mean) <= half else "yes, worse" if mean > 0 else "yes, better")
            per_seed = ", ".join(f"{d:+.4f}" for d in diffs)
        lines.append(f"| {arm} | {spread(values)} | {paired} | {verdict} | {per_seed} | "
                     + " | ".join(f"{rms[arm][k]:.4f}" for k in kinds) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(parser, out_dir="runs/bench-recipe-arms", vocab=2048, seq_len=128, batch_tokens=2048,
                   micro_batch=16, evals=10, eval_batches=16)
    parser.add_argument("--steps", type=int, default=500, help="optimizer steps per run")
    parser.add_argument("--seeds", type=int, default=4,
                        help="paired seeds: each its own initialisation and its own window of the corpus, the same "
                             "for every arm")
    parser.add_argument("--first-seed", type=int, default=1337,
                        help="the first seed, which reads the corpus's first window (processes on different seeds "
                             "share the work, each with --seeds 1 and its own --first-seed and --window; a run "
                             "already finished in --out-dir is read, not run again)")
    parser.add_argument("--window", type=int, default=0,
                        help="the corpus window the first seed reads (seed k reads window --window + k)")
    parser.add_argument("--arms", default="", help="comma-separated subset of the arms (default: all)")
    parser.add_argument("--example", default=str(SHIPPED_EXAMPLE),
                        help="the chain config whose train settings are the `shipped` arm (default: the shipped one)")
    args = parser.parse_args()

    from shared.config import TrainConfig

    corpus, data_dir = prepare_bench(args)
    arms = recipe_arms(shipped_settings(Path(args.example)), args.steps, args.n_layer)
    if args.arms:
        unknown = set(args.arms.split(",")) - set(arms)
        if unknown:
            raise UserError(f"--arms: no arm {', '.join(sorted(unknown))}; the arms are {', '.join(arms)}")
        arms = {name: arm for name, arm in arms.items() if name in args.arms.split(",") or name == "shipped"}
    eval_every = max(1, args.steps // args.evals)
    base = TrainConfig.from_dict(dict(
        preset="bench", micro_batch=args.micro_batch, total_batch_tokens=args.batch_tokens,
        data_dir=str(data_dir), backend="cpu", bf16=False, eval_batches=args.eval_batches,
        eval_every=eval_every, checkpoint_every=eval_every, keep_checkpoints=args.evals + 2,
        keep_stable=False, progress=True, wandb_project="", xla_cache=False, time_budget=1e9,
        log_every=10, total_steps=args.steps, seed=args.first_seed))
    out_root = Path(args.out_dir)
    windows = seed_data_dirs(data_dir, out_root, args.window + args.seeds, args.steps * args.batch_tokens + 1)
    print(f"corpus: {corpus['train_tokens']:,} train tokens; {len(arms)} arms x {args.seeds} seeds x {args.steps} "
          f"steps of {args.batch_tokens:,} tokens, each seed on a window of its own")
    curves: dict[str, list] = {name: [] for name in arms}
    traces: dict[str, list] = {name: [] for name in arms}
    for index in range(args.seeds):
        seed, window = base.model.seed + index, args.window + index
        for name, (settings, attn_scale) in arms.items():
            cfg = base.replace(seed=seed, data_dir=str(windows[window]), **settings)
            run_name = f"{name}-seed{seed}-window{window}"
            with attention_output_scaled(attn_scale):
                curves[name].append(run(run_name, cfg, out_root))
            traces[name].append(weight_rms_trace(out_root / run_name))
    finals = {name: [curve[-1][1] for curve in runs] for name, runs in curves.items()}
    rms = {name: final_rms_by_kind(runs[0]) for name, runs in traces.items()}
    table = report(finals, rms, args.seeds)
    title = f"GPT-2 {args.n_layer}L/{args.n_embd}d, {args.steps} steps x {args.batch_tokens:,} tokens"
    loss_png = plot_curves(curves, statistics.mean(finals["shipped"]), out_root / "val_loss.png",
                           f"{title}, {args.seeds} seeds, band: min to max", target_label="shipped's final")
    rms_png = plot_weight_rms({name: runs[0] for name, runs in traces.items()}, out_root / "weight_rms.png",
                              f"{title}: block matrices' RMS (seed {base.model.seed}; band: the layers' min to max)")
    (out_root / "report.md").write_text(f"{table}\n\n![val loss]({loss_png.name})\n\n![weight RMS]({rms_png.name})\n")
    print(table)
    print(f"plots: {loss_png}, {rms_png}")


if __name__ == "__main__":
    run_cli(main)
