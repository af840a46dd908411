"""Config dataclasses (model, training) and a command line built from them.

Every training setting lives in `TrainConfig`; a kernel's flags are generated from its fields, so a new
setting is one new field with a default and a help string.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import typing
from dataclasses import dataclass, field

from shared.errors import UserError

GPT2_VOCAB_SIZE = 50257  # the tokenizer's vocabulary
# A checkpoint holds fp32 weights and AdamW's two fp32 moments (the XLA cache and JSON are small).
CHECKPOINT_BYTES_PER_PARAM = 12
PADDED_VOCAB_SIZE = 50304  # a multiple of 128: faster matmuls; trimmed back to 50257 on export


@dataclass(frozen=True)
class ModelConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab_size: int = PADDED_VOCAB_SIZE

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})

    def num_params(self) -> int:
        """Parameters of the model (the tied head counted once), without building it: per block two LayerNorms
        (4C), attention (4C^2 + 4C) and the MLP (8C^2 + 5C); embeddings and the final LayerNorm besides."""
        c = self.n_embd
        return self.n_layer * (12 * c * c + 13 * c) + (self.vocab_size + self.block_size) * c + 2 * c

    def checkpoint_bytes(self) -> int:
        """Bytes of one checkpoint (CHECKPOINT_BYTES_PER_PARAM per parameter)."""
        return CHECKPOINT_BYTES_PER_PARAM * self.num_params()


MODEL_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layer=2, n_head=4, n_embd=128, block_size=256),
    "gpt2": ModelConfig(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": ModelConfig(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": ModelConfig(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": ModelConfig(n_layer=48, n_head=25, n_embd=1600),
}


def model_preset(name: str) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise UserError(f"--preset: unknown preset {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


NINE_HOURS = 9 * 3600.0
OPTIMIZERS = ("adamw", "muon")  # shared/train/optim.py
SCHEDULES = ("cosine", "wsd")


@dataclass
class TrainConfig:
    preset: str = field(default="tiny", metadata={"help": "model size: " + ", ".join(MODEL_PRESETS)})
    data_dir: str = field(default="data/demo", metadata={"help": "directory of *_train_*.bin / *_val_*.bin shards"})
    out_dir: str = field(default="runs/demo", metadata={"help": "checkpoints, metrics.jsonl and plots go here"})
    resume_from: str = field(
        default="", metadata={"help": "checkpoint root to resume from if out_dir has none (e.g. a Kaggle input)"}
    )
    seq_len: int = field(default=0, metadata={"help": "tokens per sequence (0: the preset's block size)"})
    micro_batch: int = field(default=16, metadata={"help": "sequences per micro-step over all devices"})
    total_batch_tokens: int = field(default=524288, metadata={"help": "tokens per optimizer step"})
    max_steps: int = field(default=19073, metadata={"help": "optimizer steps for the whole run (all sessions)"})
    warmup_steps: int = field(default=715, metadata={"help": "linear learning-rate warm-up steps"})
    optimizer: str = field(
        default="adamw", metadata={"help": "adamw, or muon (Muon for the blocks' matrices, AdamW for the rest; "
                                   "docs/recipe.md)"}
    )
    schedule: str = field(
        default="cosine", metadata={"help": "cosine (warm-up, cosine to min_lr_ratio), or wsd (warm-up, constant, "
                                  "linear decay to zero over the last cooldown_frac of the run)"}
    )
    lr: float = field(default=6e-4, metadata={"help": "peak learning rate (AdamW's, and Muon's AdamW part)"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of the peak"})
    cooldown_frac: float = field(default=0.4, metadata={"help": "wsd: the fraction of max_steps that decays"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW decay on 2-D weights only"})
    muon_lr: float = field(default=0.02, metadata={"help": "muon: peak learning rate of the blocks' matrices"})
    muon_momentum: float = field(default=0.95, metadata={"help": "muon: Nesterov momentum"})
    muon_weight_decay: float = field(default=0.01, metadata={"help": "muon: decoupled decay on its matrices"})
    grad_clip: float = field(default=1.0, metadata={"help": "global gradient-norm clip"})
    seed: int = field(default=1337, metadata={"help": "init and data-order seed"})
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
    time_budget: float = field(
        default=0.0,
        metadata={"help": "seconds this session may train before its final checkpoint (0: 9 h less a margin)"},
    )
    checkpoint_every: int = field(default=1000, metadata={"help": "steps between periodic checkpoints (0: off)"})
    keep_checkpoints: int = field(default=2, metadata={"help": "how many checkpoints to keep"})
    checkpoint_dir: str = field(
        default="", metadata={"help": "where checkpoints are written ('': out_dir/checkpoints; on Kaggle, large "
                              "models keep them in /kaggle/temp, outside the 20 GB output)"}
    )
    log_every: int = field(default=10, metadata={"help": "steps between metric log lines"})
    on_data_change: str = field(
        default="error",
        metadata={"help": "when the training shards differ from the resumed checkpoint's (token parts added or "
                  "removed): error, or new-epoch (go on with a new pass over the shards given)"},
    )
    eval_every: int = field(default=250, metadata={"help": "steps between validation-loss evals (0: off)"})
    eval_batches: int = field(default=20, metadata={"help": "micro-batches per validation-loss eval"})
    hellaswag_file: str = field(default="", metadata={"help": "HellaSwag jsonl scored at each eval ('': off)"})
    hellaswag_examples: int = field(default=1000, metadata={"help": "HellaSwag examples per eval (0: all)"})
    sample_prompt: str = field(default="", metadata={"help": "prompt sampled from at each eval ('': no samples)"})
    sample_tokens: int = field(default=32, metadata={"help": "tokens per sample at each eval"})
    stop_after_steps: int = field(
        default=0, metadata={"help": "end this session after this many steps (0: only time/max_steps end it)"}
    )
    wandb_project: str = field(
        default="gpt2-on-kaggle", metadata={"help": "W&B project, used when a key exists ('': W&B off)"}
    )
    run_name: str = field(default="", metadata={"help": "W&B run name (default: out_dir's name)"})
    wandb_run_id: str = field(
        default="", metadata={"help": "W&B run id, the same in every session of a run (default: from run_name)"}
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    @property
    def model(self) -> ModelConfig:
        base = model_preset(self.preset)
        if self.seq_len and self.seq_len != base.block_size:
            if self.seq_len > base.block_size and self.preset != "tiny":
                raise UserError(f"--seq-len {self.seq_len} exceeds {self.preset}'s block size {base.block_size}")
            base = dataclasses.replace(base, block_size=self.seq_len)
        return base

    @property
    def tokens_per_micro_step(self) -> int:
        return self.micro_batch * self.model.block_size

    @property
    def grad_accum_steps(self) -> int:
        per_micro = self.tokens_per_micro_step
        if self.total_batch_tokens % per_micro:
            raise UserError(
                f"--total-batch-tokens {self.total_batch_tokens} is not a multiple of "
                f"micro-batch x seq-len = {self.micro_batch} x {self.model.block_size} = {per_micro}"
            )
        return self.total_batch_tokens // per_micro

    def validate(self, num_devices: int = 1) -> None:
        self.model  # noqa: B018 - raises on a bad preset or sequence length
        self.grad_accum_steps  # noqa: B018
        if self.micro_batch % num_devices:
            raise UserError(f"--micro-batch {self.micro_batch} must be a multiple of the {num_devices} devices")
        if self.max_steps <= 0:
            raise UserError(f"--max-steps must be positive, got {self.max_steps}")
        if self.time_budget < 0:
            raise UserError(f"--time-budget must be >= 0, got {self.time_budget}")
        for name in ("activation_checkpointing", "scan_layers"):
            if getattr(self, name) not in ("auto", "on", "off"):
                raise UserError(f"{_flag(name)} must be auto, on or off, got {getattr(self, name)!r}")
        for name, allowed in (("optimizer", OPTIMIZERS), ("schedule", SCHEDULES)):
            if getattr(self, name) not in allowed:
                raise UserError(f"{_flag(name)} must be {' or '.join(allowed)}, got {getattr(self, name)!r}")
        if not 0.0 < self.cooldown_frac <= 1.0:
            raise UserError(f"--cooldown-frac must be in (0, 1], got {self.cooldown_frac}")
        if self.on_data_change not in ("error", "new-epoch"):
            raise UserError(f"--on-data-change must be error or new-epoch, got {self.on_data_change!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per dataclass field (`micro_batch` -> `--micro-batch`), typed from the annotation."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        help_text = f"{f.metadata.get('help', '')} (default: {f.default!r})"
        if kind is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            parser.add_argument(_flag(f.name), type=kind, default=f.default, help=help_text)


def parse_dataclass(cls: type, argv: list[str] | None = None, description: str = "", defaults: dict | None = None):
    """Parse `argv` into an instance of `cls`; `defaults` (e.g. baked into a Kaggle build) override field defaults."""
    parser = argparse.ArgumentParser(description=description)
    add_dataclass_args(parser, cls)
    if defaults:
        parser.set_defaults(**defaults)
    ns = parser.parse_args(argv)
    return cls(**vars(ns))
