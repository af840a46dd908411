"""What a long run's growth is watched by, at every eval: the RMS of the blocks' matrices by kind, and the largest
attention logit (q·k/√d over the causal positions) per layer. Muon without weight decay lets the matrices grow
over a long run (docs/recipe.md section 7, "Runs past ~20k steps"); a growing logit is where attention starts
to saturate. Both are read from the device once per eval, in one transfer each, outside the step."""

from __future__ import annotations

import math

import torch

MATRIX_KINDS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


@torch.no_grad()
def block_weight_rms(model: torch.nn.Module) -> dict[str, float]:
    """Each matrix kind's RMS, averaged over the layers (one device read for all)."""
    per_kind = []
    for kind in MATRIX_KINDS:
        owner, name = kind.split(".")
        weights = [getattr(getattr(block, owner), name).weight for block in model.transformer.h]
        per_kind.append(torch.stack([w.float().pow(2).mean().sqrt() for w in weights]).mean())
    values = torch.stack(per_kind).cpu().tolist()
    return {kind: round(value, 6) for kind, value in zip(MATRIX_KINDS, values, strict=True)}


@torch.no_grad()
def attention_logit_max(model: torch.nn.Module, idx: torch.Tensor) -> list[float]:
    """Per layer, the largest pre-softmax attention logit q·k/√d over heads, rows and causal positions of `idx`
    (B, T), with the model run block by block as it runs in training (one device read for all layers)."""
    x = model.transformer.wte(idx) + model.transformer.wpe.weight[: idx.shape[1]]
    T, maxima = idx.shape[1], []
    future = torch.ones(T, T, dtype=torch.bool, device=idx.device).triu(1)
    for block in model.transformer.h:
        attn = block.attn
        B, _, C = x.shape
        q, k, _ = attn.c_attn(block.ln_1(x)).split(C, dim=2)
        q, k = (t.view(B, T, attn.n_head, C // attn.n_head).transpose(1, 2).float() for t in (q, k))
        logits = (q @ k.transpose(-2, -1)) / math.sqrt(C // attn.n_head)
        maxima.append(logits.masked_fill(future, float("-inf")).max())
        x = block(x)
    return [round(v, 4) for v in torch.stack(maxima).cpu().tolist()]


def health_record(model: torch.nn.Module, runtime, rows, bf16: bool) -> dict:
    """The eval's health line: `weight_rms` by kind, `attn_logit_max` (the largest over layers) and its layer,
    from `rows` (a numpy (B, T+1) token batch: its inputs)."""
    batch = runtime.batch_to_device(rows)
    with runtime.autocast(bf16):
        per_layer = attention_logit_max(model, batch[:, :-1])
    top = max(range(len(per_layer)), key=per_layer.__getitem__)
    return {"weight_rms": block_weight_rms(model), "attn_logit_max": per_layer[top], "attn_logit_max_layer": top}
