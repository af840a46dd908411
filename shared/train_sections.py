"""The train kernel's settings, in the sections a reader looks for them: the model, the data, the optimizer, the
learning-rate schedule, the step's structure, the session, the evals and logging (`TRAIN_SECTIONS`).
`shared.config.TrainConfig` holds one object of each (`cfg.optim.lr`); every field is still one flag
(`--lr_schedule.total_steps`, alias `--total-steps`) and one key of a chain config's `train` (nested under its
section's name, `{"optim": {"lr": 0.0036}}`, or flat: `flatten_sections`). Each section checks its own fields
(`Section.check`) when built; TrainConfig runs every section's check again, then those that span sections.
Standard library only."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from shared.errors import UserError
from shared.flags import at_least, check_field_types, check_known, flag, one_of, positive
from shared.model_shape import MODEL_PRESETS, ModelConfig, model_preset

AUTO = "auto"
BACKENDS = ("auto", "xla", "cuda", "cpu")
# The attention setting's words: auto, or the kernel a session tries first (shared/model/attention.py owns the order).
ATTENTION_SETTINGS = ("auto", "splash", "flash", "sdpa")
OPTIMIZERS = ("adamw", "muon")  # shared/runtime/optim.py
SCHEDULES = ("cosine", "wsd")
# Settings renamed, by their old names: a run's length was `max_steps` in the train kernel and `total_steps` in the
# chain; it is total_steps everywhere now. Old configs (a user's, a checkpoint's carried one) and the old flag still
# work: `current_names` reads them, and shared/flags.py keeps each old flag as an alias of the new one.
RENAMED = {"max_steps": "total_steps"}


class Section:
    """A section of the train settings: checked when built (types, then its own `check`)."""

    def __post_init__(self) -> None:
        check_field_types(self)
        self.check()

    def check(self) -> None:
        """This section's own checks: ranges and choices, and what ties its fields together."""


@dataclass
class ModelSettings(Section):
    """The model: its size (a preset), sequence length, initialisation and seed."""

    preset: str = field(default="tiny", metadata={"help": "model size: " + ", ".join(MODEL_PRESETS)})
    seq_len: int = field(default=0, metadata={"help": "tokens per sequence (0: the preset's block size)"})
    seed: int = field(default=1337, metadata={"help": "init and data-order seed"})
    zero_init_projections: bool = field(default=False, metadata={
        "help": "start the attention and MLP output projections (c_proj) at zero (modded-nanogpt's 2024-10-14 record; "
                "initialisation only: the architecture and the Hugging Face export are unchanged)"})

    @property
    def shape(self) -> ModelConfig:
        """The model's shape: the preset's, with `seq_len` as its block size where set."""
        base = model_preset(self.preset)
        if self.seq_len and self.seq_len != base.block_size:
            if self.seq_len > base.block_size and self.preset != "tiny":
                raise UserError(f"--seq-len {self.seq_len} exceeds {self.preset}'s block size {base.block_size}")
            base = dataclasses.replace(base, block_size=self.seq_len)
        return base

    def check(self) -> None:
        at_least(self, 0, "seq_len")
        self.shape  # noqa: B018 - raises on a bad preset or sequence length


@dataclass
class DataSettings(Section):
    """The training data: where its shards are, and what a resumed run does when they changed."""

    data_dir: str = field(default="data/demo", metadata={"help": "directory of *_train_*.bin / *_val_*.bin shards"})
    on_data_change: str = field(
        default="error",
        metadata={"help": "when the training shards differ from the resumed checkpoint's (token parts added or "
                  "removed): error, or new-epoch (go on with a new pass over the shards given)"},
    )

    def check(self) -> None:
        one_of(self, "on_data_change", ("error", "new-epoch"))


@dataclass
class OptimizerSettings(Section):
    """The optimizer: AdamW, or Muon for the blocks' matrices with AdamW for the rest; its learning rates (peaks),
    momenta, decays and the gradient clip."""

    optimizer: str = field(
        default="adamw", metadata={"help": "adamw, or muon (Muon for the blocks' matrices, AdamW for the rest; "
                                   "docs/recipe.md)"}
    )
    lr: float = field(default=6e-4, metadata={"help": "peak learning rate (AdamW's, and Muon's AdamW part)"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW decay on 2-D weights only"})
    muon_lr: float = field(default=0.02, metadata={"help": "muon: peak learning rate of the blocks' matrices"})
    muon_scale: str = field(default="shape", metadata={
        "help": "muon: how an orthogonalised update is scaled: shape (x sqrt(max(1, rows/cols)), KellerJordan/Muon "
                "muon.py; muon_lr about 0.02), or max_dim (x sqrt(max(rows, cols)): every matrix moves by muon_lr "
                "RMS per element, the speedrun's 2024-10-10 Muon record; muon_lr 0.00036 there)"})
    aux_lr: float = field(default=0.0, metadata={
        "help": "muon (or --matrix-lr): peak learning rate of the position embedding, biases and LayerNorm gains "
                "(0: --lr, which the token embedding and tied head take)"})
    matrix_lr: float = field(default=0.0, metadata={
        "help": "adamw: peak learning rate of the blocks' matrices (the ones Muon would train; the rest keep --lr), "
                "on the same schedule (0: --lr): scripts/bench_recipe.py's AdamW control, with Muon's groups"})
    muon_momentum: float = field(default=0.95, metadata={"help": "muon: Nesterov momentum"})
    muon_momentum_warmup_steps: int = field(default=0, metadata={
        "help": "muon: steps over which the momentum rises linearly from --muon-momentum-start to --muon-momentum "
                "(modded-nanogpt's records: 0.85 -> 0.95 over 300; docs/recipe-sources.md); 0: constant"})
    muon_momentum_start: float = field(default=0.85, metadata={"help": "muon: the momentum at step 0 of the warm-up"})
    muon_weight_decay: float = field(default=0.01, metadata={"help": "muon: decoupled decay on its matrices"})
    grad_clip: float = field(default=1.0, metadata={"help": "global gradient-norm clip (0: none; the norm is logged)"})

    def check(self) -> None:
        at_least(self, 0, "weight_decay", "muon_weight_decay", "grad_clip", "muon_momentum_warmup_steps", "matrix_lr",
                 "aux_lr")
        positive(self, "lr", "muon_lr")
        one_of(self, "optimizer", OPTIMIZERS)
        one_of(self, "muon_scale", ("shape", "max_dim"))
        for name in ("muon_momentum", "muon_momentum_start"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UserError(f"{flag(name)} must be in [0, 1), got {getattr(self, name)}")
        if self.matrix_lr and self.optimizer != "adamw":
            raise UserError("--matrix-lr is AdamW's; Muon's matrices take --muon-lr")
        if self.aux_lr and self.optimizer != "muon" and not self.matrix_lr:
            raise UserError("--aux-lr sets Muon's AdamW part (or --matrix-lr's groups); plain AdamW takes --lr")


@dataclass
class ScheduleSettings(Section):
    """The schedule: the whole run's length in steps and how the learning rates rise, hold and fall over it."""

    total_steps: int = field(default=19073, metadata={"help": "optimizer steps for the whole run (all sessions)"})
    warmup_steps: int = field(default=715, metadata={"help": "linear learning-rate warm-up steps"})
    schedule: str = field(
        default="cosine", metadata={"help": "cosine (warm-up, cosine to min_lr_ratio), or wsd (warm-up, constant, "
                                  "linear decay to zero over the last cooldown_frac of the run)"}
    )
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of the peak"})
    cooldown_frac: float = field(default=0.4, metadata={"help": "wsd: the fraction of total_steps that decays"})
    cooldown_shape: str = field(default="linear", metadata={
        "help": "wsd: the decay's shape, linear or 1-sqrt (1 - sqrt(progress), epfml/schedules-and-scaling "
                "src/optim/utils.py)"})
    extend: bool = field(default=False, metadata={
        "help": "wsd: lengthen a run to this --total-steps (a later decay): resume from its newest checkpoint that "
                "the new schedule agrees with (the stable-phase one, once), setting aside the shorter schedule's "
                "decayed checkpoints; every session of the longer run keeps the flag"})

    def check(self) -> None:
        at_least(self, 0, "warmup_steps", "min_lr_ratio")
        positive(self, "total_steps")
        one_of(self, "schedule", SCHEDULES)
        one_of(self, "cooldown_shape", ("linear", "1-sqrt"))
        if self.min_lr_ratio > 1:
            raise UserError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.cooldown_frac <= 1.0:
            raise UserError(f"--cooldown-frac must be in (0, 1], got {self.cooldown_frac}")
        if self.extend and self.schedule != "wsd":
            raise UserError("--extend needs --schedule wsd: a cosine schedule depends on --total-steps from the end of "
                            "its warm-up, so no later checkpoint agrees with a longer one")


@dataclass
class StepSettings(Section):
    """The step's structure: the batch and its micro-batches, precision, the backend, and how XLA compiles the step
    (the attention kernel among it)."""

    total_batch_tokens: int = field(default=524288, metadata={"help": "tokens per optimizer step"})
    micro_batch: int | str = field(default=16, metadata={
        "help": "sequences per micro-step over all devices, or auto: the most that fits, from the TPU generation, "
                "the attention kernel and the model (shared/tpu.py auto_micro_batch; docs/tpu-throughput.md)"})
    fsdp: bool = field(default=False, metadata={"help": "shard params, grads and AdamW state over the mesh"})
    bf16: bool = field(
        default=True, metadata={"help": "bf16 autocast, fp32 master weights (fp16 + loss scaling without bf16)"}
    )
    backend: str = field(default="auto", metadata={"help": "xla (TPU or torch_xla CPU devices), cuda, cpu, auto"})
    xla_cache: bool = field(
        default=True, metadata={"help": "keep XLA's compiled graphs in the checkpoints, for the next session"}
    )
    compile: bool = field(default=True, metadata={"help": "torch.compile the model on CUDA (XLA compiles anyway)"})
    grad_accum_loop: bool = field(
        default=True, metadata={"help": "XLA: run a step's micro-batches as one compiled loop, the step one graph "
                                "(off: one graph per micro-step)"}
    )
    activation_checkpointing: str = field(
        default="auto", metadata={"help": "recompute each block's activations in the backward pass: on, off, or "
                                  "auto (on where the TPU's memory needs it: gpt2-medium and up on 16 GB devices)"}
    )
    scan_layers: str = field(
        default="auto", metadata={"help": "XLA: compile one block for the whole stack (torch_xla scan; needs jax and "
                                  "torchax): on, off, or auto (on a TPU with SDPA attention, 24+ layers)"}
    )
    attention: str = field(default="auto", metadata={
        "help": "the attention kernel a TPU session tries first, each probed and the next tried where it fails: auto "
                "(splash, then flash, then SDPA), splash, flash (skips splash) or sdpa (no Pallas kernel); a kernel "
                "the TPU or the sequence length rules out is skipped (shared/model/attention.py)"})

    def check(self) -> None:
        positive(self, "total_batch_tokens")
        if self.micro_batch != AUTO:
            if not isinstance(self.micro_batch, int) or isinstance(self.micro_batch, bool):
                raise UserError(f"--micro-batch: expected a whole number or auto, got {self.micro_batch!r}")
            positive(self, "micro_batch")
        for name in ("activation_checkpointing", "scan_layers"):
            one_of(self, name, ("auto", "on", "off"))
        one_of(self, "backend", BACKENDS)
        one_of(self, "attention", ATTENTION_SETTINGS)


@dataclass
class SessionSettings(Section):
    """The session: where it writes, how long it may train, and its checkpoints."""

    out_dir: str = field(default="runs/demo", metadata={"help": "checkpoints, metrics.jsonl and plots go here"})
    resume_from: str = field(
        default="", metadata={"help": "checkpoint root to resume from if out_dir has none (e.g. a Kaggle input)"}
    )
    checkpoint_dir: str = field(
        default="", metadata={"help": "where checkpoints are written ('': out_dir/checkpoints; on Kaggle, large "
                              "models keep them in /kaggle/temp, outside the 20 GB output)"}
    )
    time_budget: float = field(
        default=0.0,
        metadata={"help": "seconds this session may train before its final checkpoint, counted from the end of its "
                  "first step: start-up (probes, compiles, the baseline eval) is not in it (0: 9 h less a margin, "
                  "counted from training's start)"},
    )
    session_deadline: float = field(
        default=0.0,
        metadata={"help": "seconds from the session's start (the kernel process's) by which training and its final "
                  "checkpoint are done, however long start-up took (0: none; a chain sets its limit less publishing)"},
    )
    stop_after_steps: int = field(
        default=0, metadata={"help": "end this session after this many steps (0: only time/total_steps end it)"}
    )
    checkpoint_every: int = field(default=1000, metadata={"help": "steps between periodic checkpoints (0: off)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many checkpoints to keep"})
    keep_stable: bool = field(default=True, metadata={
        "help": "wsd: also keep the checkpoint where the stable phase ends (every full-LR update, none decayed) "
                "in <checkpoints>/stable/, which --extend trains on from"})

    def check(self) -> None:
        at_least(self, 0, "time_budget", "session_deadline", "checkpoint_every", "stop_after_steps")
        positive(self, "keep_checkpoints")


@dataclass
class EvalSettings(Section):
    """The evals during training: validation loss, HellaSwag and a sample, and how often."""

    eval_every: int = field(default=250, metadata={"help": "steps between validation-loss evals (0: off)"})
    eval_batches: int = field(default=20, metadata={"help": "micro-batches per validation-loss eval"})
    hellaswag_file: str = field(default="", metadata={"help": "HellaSwag jsonl scored during training ('': off)"})
    hellaswag_examples: int = field(default=0, metadata={
        "help": "HellaSwag examples scored: a seeded random sample of N, the same every time (0: all)"})
    hellaswag_every: int = field(default=1000, metadata={
        "help": "HellaSwag at the first eval at or past each multiple of this step, at the stable phase's end and "
                "at the last step (0: at every eval)"})
    sample_prompt: str = field(default="", metadata={"help": "prompt sampled from at each eval ('': no samples)"})
    sample_tokens: int = field(default=32, metadata={"help": "tokens per sample at each eval"})

    def check(self) -> None:
        at_least(self, 0, "eval_every", "hellaswag_examples", "hellaswag_every", "sample_tokens")
        positive(self, "eval_batches")


@dataclass
class LoggingSettings(Section):
    """Logging: the metric lines, W&B, the progress bar and the profiler."""

    log_every: int = field(default=10, metadata={"help": "steps between metric log lines"})
    wandb_project: str = field(
        default="gpt2-on-kaggle", metadata={"help": "W&B project, used when a key exists ('': W&B off)"}
    )
    run_name: str = field(default="", metadata={"help": "W&B run name (default: out_dir's name)"})
    wandb_run_id: str = field(
        default="", metadata={"help": "W&B run id, the same in every session of a run (default: from run_name)"}
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    profile_steps: int = field(default=0, metadata={
        "help": "XLA: trace this many steps with torch_xla's profiler once the step has compiled (from the session's "
                "third step) into out_dir/profile/, for TensorBoard's profile plugin: per-op device time to hold "
                "against the compiler's roofline (scripts/hlo_cost.py); 0: off"})

    def check(self) -> None:
        at_least(self, 0, "profile_steps")
        positive(self, "log_every")


# TrainConfig's sections by the name a nested `train` config gives each (shared/train_sections.py flatten_sections)
TRAIN_SECTIONS: dict[str, type] = {"model": ModelSettings, "data": DataSettings, "optim": OptimizerSettings,
                                   "lr_schedule": ScheduleSettings, "step": StepSettings, "session": SessionSettings,
                                   "evals": EvalSettings, "logging": LoggingSettings}


def section_fields(sections: dict[str, type] = TRAIN_SECTIONS) -> dict[str, str]:
    """{field name: its section's name} over `sections` ({name: section class}; the train settings' by default)."""
    return {f.name: name for name, section in sections.items() for f in fields(section)}


def current_names(settings: dict, where: str = "train") -> dict:
    """`settings` with each old name (RENAMED) replaced by its current one; both spellings at once is an error."""
    out = dict(settings)
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise UserError(f"{where}: {new} is set twice ({old} is its old name)")
            out[new] = out.pop(old)
    return out


def flatten_sections(settings: dict, where: str = "train") -> dict:
    """Train settings written flat (`{"lr": ...}`), nested under their sections' names (`{"optim": {"lr": ...}}`),
    or both, under current names or old (`current_names`), as one flat dict: the one reader of a train config, the
    chain's and any script's. An unknown key, a key under the wrong section, or one set twice is a one-line error."""
    sections = TRAIN_SECTIONS
    owner = section_fields()
    flat = current_names({key: value for key, value in settings.items() if key not in sections}, where)
    check_known(flat, owner, where, "train")
    for name in sections:
        nested = settings.get(name)
        if nested is None:
            continue
        if not isinstance(nested, dict):
            raise UserError(f"{where}.{name}: a section of settings ({{\"key\": value, ...}}), got {nested!r}")
        for key, value in current_names(nested, f"{where}.{name}").items():
            if owner.get(key) != name:
                home = f"; it belongs in the {owner[key]} section" if key in owner else ""
                raise UserError(f"{where}.{name}: {key} is not a setting of this section{home}")
            if key in flat:
                raise UserError(f"{where}: {key} is set twice ({where}.{key} and {where}.{name}.{key})")
            flat[key] = value
    return flat


def saved_settings(settings: dict, where: str) -> dict:
    """A checkpoint's carried train settings (nested, or flat as written before the sections were objects; old
    names too) as one flat dict, a setting the code no longer has dropped: what a resume or an eval reads of the
    run that wrote it."""
    owner, sections = section_fields(), TRAIN_SECTIONS
    known = set(owner) | set(RENAMED)
    kept = {key: value for key, value in settings.items() if key in known}
    for name in sections:
        if isinstance(settings.get(name), dict):
            kept[name] = {key: value for key, value in settings[name].items()
                          if owner.get(RENAMED.get(key, key)) == name}
    return flatten_sections(kept, where)
