"""The chunked loss head (shared/model/loss_head.py) against plain PyTorch's: the tied projection then
F.cross_entropy over fp32 logits with the padded columns masked, as the model computed its loss before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shared.model.loss_head import CHUNK_POSITIONS, head_loss

B, C, V, REAL_V = 3, 48, 700, 690
T = 2 * CHUNK_POSITIONS + 41  # three chunks, the last one short


def plain_loss(hidden, weight, targets, padding):
    logits = (hidden @ weight.t()).float().masked_fill(padding, float("-inf"))
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


@pytest.fixture
def inputs():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, C, generator=gen, requires_grad=True)
    weight = (0.3 * torch.randn(V, C, generator=gen)).requires_grad_()
    targets = torch.randint(0, REAL_V, (B, T), generator=gen)
    return hidden, weight, targets, torch.arange(V) >= REAL_V


def grads(fn, hidden, weight, targets, padding, bf16=False, scale=1.0):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = fn(hidden, weight, targets, padding)
    return loss, torch.autograd.grad(loss * scale, (hidden, weight))


def test_in_fp32_the_loss_and_gradients_are_plain_pytorchs(inputs):
    loss, (d_hidden, d_weight) = grads(head_loss, *inputs, scale=0.25)  # a scaled loss, as loss / accum
    want_loss, (want_hidden, want_weight) = grads(plain_loss, *inputs, scale=0.25)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    torch.testing.assert_close(d_hidden, want_hidden, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(d_weight, want_weight, rtol=1e-5, atol=1e-8)
    assert d_weight[REAL_V:].abs().max() == 0  # the padded columns get no gradient
    with torch.no_grad():  # evaluation: the same loss, no gradients made
        assert head_loss(*inputs).item() == pytest.approx(want_loss.item(), rel=1e-6)


def test_under_bf16_autocast_it_is_as_close_to_the_exact_gradients_as_plain_pytorchs(inputs):
    hidden, weight, targets, padding = inputs
    exact_loss, exact = grads(plain_loss, hidden.double(), weight.double(), targets, padding)
    loss, got = grads(head_loss, *inputs, bf16=True)
    plain_loss_bf16, plain = grads(plain_loss, *inputs, bf16=True)
    assert loss.item() == pytest.approx(exact_loss.item(), rel=2e-3)
    assert abs(loss.item() - exact_loss.item()) <= 2 * abs(plain_loss_bf16.item() - exact_loss.item()) + 1e-4
    for g, p, e in zip(got, plain, exact, strict=True):
        assert g.dtype == torch.float32  # the parameters' and hidden states' own dtype
        error, plain_error = ((g - e).abs().max() / e.abs().max()).item(), ((p - e).abs().max() / e.abs().max()).item()
        assert error <= 1.5 * plain_error and error < 0.02, (error, plain_error)  # bf16: 2^-8 a rounding


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_the_production_step_trains_as_with_plain_pytorchs_head(demo_data, tmp_path, monkeypatch, optimizer):
    """Under XLA (8 CPU devices, the accumulation loop, bf16 autocast): 6 steps with the chunked head (4 chunks of 8
    positions here) give the losses of the same run with the plain head, within bf16's rounding."""
    from helpers import small_config, train_in_process

    import shared.model.loss_head as loss_head
    import shared.model.model as model
    from shared.train.metrics import read_metrics

    monkeypatch.setattr(loss_head, "CHUNK_POSITIONS", 8)
    runs = {}
    for head in ("chunked", "plain"):
        if head == "plain":
            monkeypatch.setattr(model, "head_loss", lambda h, w, t, p: plain_loss(h, w.to(h.dtype), t.long(), p))
        cfg = small_config(demo_data, tmp_path / head, optimizer=optimizer, lr=3e-3, muon_lr=0.03)
        assert cfg.grad_accum_steps == 2
        train_in_process(cfg)
        runs[head] = [r["loss"] for r in read_metrics(tmp_path / head / "metrics.jsonl") if "loss" in r]
    chunked, plain = runs["chunked"], runs["plain"]
    assert len(chunked) == len(plain) == 6 and chunked[-1] < chunked[0] - 0.3  # it trains
    assert chunked[0] == pytest.approx(plain[0], rel=1e-4)  # the same weights: the same loss
    assert chunked == pytest.approx(plain, rel=1e-2)
