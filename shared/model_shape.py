"""The model's shape (`ModelConfig`: layers, heads, width, context, vocabulary) and its presets by name, with what
follows from a shape alone: parameters, FLOPs per token, a checkpoint's bytes. Standard library only; the train
settings' model section (shared/train_sections.py ModelSettings) names a preset from here."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from shared.errors import UserError
from shared.flags import check_field_types, positive

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

    def __post_init__(self) -> None:
        check_field_types(self)
        positive(self, "n_layer", "n_head", "n_embd", "block_size", "vocab_size")
        if self.n_embd % self.n_head:
            raise UserError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")

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

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 N (forward 2N, backward 4N) + 12 L C T for attention's scores and values
        (docs/tpu-throughput.md section 1)."""
        return 6 * self.num_params() + 12 * self.n_layer * self.n_embd * self.block_size

    def flops_per_token_llmc(self) -> int:
        """The same in llm.c's convention (train_gpt2.cu `gpt2_estimate_mfu`: 6 N + 6 L C T), which counts causal
        attention's half of the scores: the figure to hold against llm.c's and MaxText's MFU (docs/tpu-throughput.md
        section 1)."""
        return 6 * self.num_params() + 6 * self.n_layer * self.n_embd * self.block_size

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


def different_shape_error(source: str | os.PathLike, differences: dict[str, tuple]) -> UserError:
    """The one-line error for a checkpoint of another model shape: {field or tensor: (checkpoint's, run's)}."""
    listed = ", ".join(f"{name}={saved} (run asks {asked})" for name, (saved, asked) in differences.items())
    return UserError(f"{source}: checkpoint is a different model shape: {listed}")
