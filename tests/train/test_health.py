"""The model's health at every eval (shared/train/health.py): the blocks' matrices' RMS by kind, and the largest
attention logit over the causal positions only."""

import math

import numpy as np
import pytest
import torch

from shared.model.model import GPT
from shared.model_shape import ModelConfig
from shared.runtime.runtime import Runtime
from shared.train.health import MATRIX_KINDS, attention_logit_max, block_weight_rms, health_record


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=8, block_size=16, vocab_size=64)).eval()


def test_the_weight_rms_of_each_kind_is_the_layers_mean():
    model = tiny_gpt()
    with torch.no_grad():
        for layer, block in enumerate(model.transformer.h):
            for number, (owner, name) in enumerate(kind.split(".") for kind in MATRIX_KINDS):
                weight = getattr(getattr(block, owner), name).weight
                weight.copy_(torch.full_like(weight, (number + 1) * (layer + 1)) * torch.sign(torch.randn_like(weight)))
    # Kind k holds (k + 1) in layer 0 and 2 (k + 1) in layer 1, signs at random: its mean RMS is 1.5 (k + 1).
    assert block_weight_rms(model) == {kind: pytest.approx(1.5 * (k + 1)) for k, kind in enumerate(MATRIX_KINDS)}


def naive_causal_logit_max(model: GPT, idx: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per layer, the largest q_i . k_j / sqrt(d) over j <= i, and over every j (the future included)."""
    x = model.transformer.wte(idx) + model.transformer.wpe.weight[: idx.shape[1]]
    causal, every = [], []
    for block in model.transformer.h:
        C, H = x.shape[-1], block.attn.n_head
        q, k, _ = block.attn.c_attn(block.ln_1(x)).split(C, dim=2)
        d = C // H
        best_causal = best_every = -math.inf
        for b in range(idx.shape[0]):
            for h in range(H):
                for i in range(idx.shape[1]):
                    for j in range(idx.shape[1]):
                        value = float(q[b, i, h * d:(h + 1) * d] @ k[b, j, h * d:(h + 1) * d]) / math.sqrt(d)
                        best_every = max(best_every, value)
                        if j <= i:
                            best_causal = max(best_causal, value)
        causal.append(best_causal)
        every.append(best_every)
        x = block(x)
    return causal, every


@torch.no_grad()
def test_the_largest_attention_logit_counts_only_the_positions_a_row_attends_to():
    model = tiny_gpt(seed=3)
    with torch.no_grad():
        for block in model.transformer.h:  # logits large enough to tell apart
            block.attn.c_attn.weight.mul_(20)
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))
    causal, every = naive_causal_logit_max(model, idx)
    assert attention_logit_max(model, idx) == pytest.approx(causal, abs=1e-3)
    assert any(e > c + 1e-2 for c, e in zip(causal, every, strict=True))  # the future would have changed it


def test_the_health_record_names_the_layer_with_the_largest_logit():
    model = tiny_gpt(seed=1)
    rows = np.random.default_rng(0).integers(0, 64, size=(2, 13)).astype(np.int32)
    record = health_record(model, Runtime(), rows, bf16=False)
    per_layer = attention_logit_max(model, torch.from_numpy(rows[:, :-1]).long())
    assert record["attn_logit_max"] == max(per_layer)
    assert record["attn_logit_max_layer"] == per_layer.index(max(per_layer))
    assert record["weight_rms"] == block_weight_rms(model)
