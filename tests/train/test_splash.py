"""jax's splash attention in the train step (shared/model/splash.py): its numerics, run in Pallas's interpreter on
the 8 XLA CPU devices with the batch sharded as training shards it, and the order a TPU session tries the kernels
in (splash, flash, SDPA), each kept only where its probe passes."""

import numpy as np
import pytest
import torch
from helpers import train_config

import shared.runtime.attention_select as attention_select
from shared.model.attention import splash_fits
from shared.model.splash import splash_attention
from shared.runtime.attention_probe import probe_attention_kernel, sdpa_causal
from shared.tpu import TPU_GENERATIONS

SHAPE = (8, 2, 256, 64)  # one sequence a device; 256 tokens: one block


def attention_and_grads(kernel, inputs, runtime):
    q, k, v, grad = [runtime.shard_batch(t.to(runtime.device)) for t in inputs]
    for t in (q, k, v):
        t.requires_grad_(True)
    out = kernel(q, k, v)
    (out * grad).sum().backward()
    runtime.sync()
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.slow
@pytest.mark.parametrize("reuse_forward", [True, False], ids=["backward-from-residuals", "forward-run-again"])
def test_splash_attention_equals_sdpa_forward_and_backward_with_the_batch_sharded(xla_runtime, reuse_forward):
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(SHAPE, generator=gen) for _ in range(4)]
    kernel = splash_attention(xla_runtime.mesh, interpret=True, reuse_forward=reuse_forward)
    got = attention_and_grads(kernel, inputs, xla_runtime)
    want = attention_and_grads(sdpa_causal, inputs, xla_runtime)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert (g - w).abs().max().item() <= 1e-5 * w.abs().max().item(), name
    # And as a session's probe sees it: bf16 inputs against SDPA in fp32, within the probe's tolerance.
    assert probe_attention_kernel(kernel, SHAPE, xla_runtime.device,
                                  xla_runtime.shard_batch, xla_runtime.sync) is None


@pytest.mark.slow
def test_without_gradients_splash_runs_its_plain_forward_and_writes_no_logsumexp(xla_runtime, monkeypatch):
    import torch_xla.core.xla_builder as xb

    from shared.model import splash

    called = []
    call_jax = xb.call_jax
    monkeypatch.setattr(xb, "call_jax", lambda fn, args: called.append(fn) or call_jax(fn, args))
    kernel = splash_attention(xla_runtime.mesh, interpret=True, reuse_forward=True)
    q, k, v = (xla_runtime.shard_batch(torch.randn(SHAPE).to(xla_runtime.device)) for _ in range(3))
    with torch.no_grad():  # an eval: no backward to keep the logsumexp for
        plain = kernel(q, k, v)
    q.requires_grad_(True)
    saving = kernel(q, k, v)
    xla_runtime.sync()
    assert called == [splash._FUNCTIONS[True][0], splash._SAVING_FUNCTIONS[True][0]]
    assert torch.equal(plain.detach().cpu(), saving.detach().cpu())


@pytest.mark.slow
def test_a_step_with_splash_attention_gives_sdpas_loss_and_gradients(xla_runtime):
    from shared.model.attention import SDPA_CHOICE, SPLASH, kernel_choice
    from shared.model.model import GPT

    cfg = train_config(preset="tiny", seq_len=256)
    tokens = np.random.default_rng(0).integers(0, 50257, (2, 8, 257)).astype(np.int32)  # 2 micro-steps of 8
    results = []
    splash = kernel_choice(SPLASH, splash_attention(xla_runtime.mesh, interpret=True), 256)  # as a session's
    for attention in (splash, SDPA_CHOICE):
        torch.manual_seed(0)
        model = xla_runtime.prepare_model(GPT(cfg.model.shape, attention), fsdp=False)
        loss = xla_runtime.forward_backward(model, tokens, bf16=False, scaler=None)
        xla_runtime.sync()
        results.append((loss.item(), [p.grad.detach().cpu() for p in model.parameters()]))
    (loss, grads), (want_loss, want_grads) = results
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        assert (g - w).abs().max().item() <= 1e-4 * w.abs().max().item() + 1e-7


def wrong_dv(q, k, v):
    out = sdpa_causal(q, k, v)
    return out + 0.5 * (v - v.detach())  # right forward, dv off by half


@pytest.mark.parametrize("splash_kernel, flash_kernel, attention, notice", [
    ("right", "right", "pallas-splash", ""),
    ("wrong", "right", "pallas-flash", "trying the flash-attention kernel"),
    ("wrong", None, "sdpa", ""),  # no flash kernel (jax did not import): splash, which needs jax too, is not tried
    (None, "right", "pallas-flash", ""),
])
def test_a_session_tries_splash_then_flash_then_sdpa_keeping_the_first_that_passes_its_probe(
        xla_runtime, monkeypatch, capsys, splash_kernel, flash_kernel, attention, notice):
    kernels = {"right": sdpa_causal, "wrong": wrong_dv, None: None}
    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v5e"])
    monkeypatch.setattr(attention_select, "splash_attention_kernel", lambda mesh, instead: kernels[splash_kernel])
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: kernels[flash_kernel])
    choice = xla_runtime.select_attention(*SHAPE)
    assert choice.kind == attention
    assert choice.kernel is (None if attention == "sdpa" else sdpa_causal)
    out = capsys.readouterr().out
    if flash_kernel:  # first the line that says which kernels are probed, and in what time
        start, out = out.split("\n", 1)
        assert start.startswith("probing attention kernels: ") and start.endswith(", at most 15 minutes in all")
    if not notice:
        assert out == ""
    else:
        assert out.count("\n") == 1 and out.startswith(
            "notice: the Pallas splash-attention kernel failed its probe at this session's shapes (1 sequences x 2 "
            "heads x 256 tokens x 64 per device): it differs from SDPA: dv by 0.469 (max error over SDPA's largest "
            "value; tolerance 0.03)")
        assert out.endswith(f"; {notice}\n")


def test_on_a_host_whose_kernels_cannot_run_both_probes_fail_in_a_line_each_and_sdpa_trains(xla_runtime,
                                                                                           monkeypatch, capsys):
    # The real kernels, lowered for a TPU, on the CPU devices: Mosaic cannot run them, as a TPU whose jax and
    # libtpu disagree could not. Each probe says so in one line, and the session goes on with SDPA.
    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v6e"])
    choice = xla_runtime.select_attention(*SHAPE)
    assert (choice.kind, choice.kernel) == ("sdpa", None)
    lines = capsys.readouterr().out.splitlines()[1:]  # after the line that starts the probing
    assert [line.split(" failed its probe")[0] for line in lines] == [
        "notice: the Pallas splash-attention kernel", "notice: the Pallas flash-attention kernel"]
    assert lines[0].endswith("; trying the flash-attention kernel") and lines[1].endswith("; using SDPA")


@pytest.mark.slow
def test_the_backward_from_residuals_equals_the_recomputed_one_over_gpt2s_blocks():
    # gpt2's 1,024 tokens make 2 x 2 blocks of 512: one skipped above the diagonal, two partial on it. jax alone,
    # Pallas's interpreter; both backward paths against each other and against dense causal attention.
    import jax
    import jax.numpy as jnp

    from shared.model.splash import _backward, _backward_from_residuals, _forward_saving

    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v, grad = (jax.random.normal(key, (1, 2, 1024, 64), jnp.float32) for key in keys)
    out, logsumexp = _forward_saving(q, k, v, interpret=True)
    from_residuals = _backward_from_residuals(q, k, v, out, logsumexp, grad, interpret=True)
    recomputed = _backward(q, k, v, grad, interpret=True)

    def dense(q, k, v):
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) / 8.0
        scores = jnp.where(jnp.tril(jnp.ones((1024, 1024), bool)), scores, -jnp.inf)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(scores, axis=-1), v)

    want_out, vjp = jax.vjp(dense, q, k, v)
    assert float(jnp.abs(out - want_out).max()) <= 1e-5 * float(jnp.abs(want_out).max())
    for got, again, want in zip(from_residuals, recomputed, vjp(grad), strict=True):
        scale = float(jnp.abs(want).max())
        assert float(jnp.abs(got - again).max()) <= 1e-6 * scale
        assert float(jnp.abs(got - want).max()) <= 1e-5 * scale


def test_the_backward_reads_the_forwards_residuals_only_where_jaxs_private_rule_takes_them(monkeypatch):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel

    from shared.model.splash import backward_rule_usable

    assert backward_rule_usable()  # this jax (0.7.x): the backward runs two kernels, not three
    real = kernel._splash_attention_bwd

    def reordered(res, do, save_residuals, mask_value, is_mqa, block_sizes, residual_checkpoint_name, mask_function,
                  attn_logits_soft_cap, interpret):
        return real(save_residuals, mask_value, is_mqa, block_sizes, residual_checkpoint_name, mask_function,
                    attn_logits_soft_cap, interpret, res, do)

    monkeypatch.setattr(kernel, "_splash_attention_bwd", reordered)  # a jax that lays its rule out otherwise
    assert not backward_rule_usable()
    monkeypatch.delattr(kernel, "_splash_attention_bwd")
    assert not backward_rule_usable()


def test_splash_is_tried_only_where_its_blocks_tile_the_sequence():
    assert splash_fits(1024) and splash_fits(256) and splash_fits(2048) and splash_fits(128)
    assert not splash_fits(64) and not splash_fits(200) and not splash_fits(1000)


def test_the_kernel_runs_only_at_the_length_its_probe_passed_and_sdpa_takes_the_rest(xla_runtime, monkeypatch):
    # The in-training HellaSwag eval's rows are shorter than the training sequence (the longest row rounded up to
    # 32), and a Pallas kernel's blocks may not tile them (splash at 192 tokens: "bkv_compute=192 must be a
    # multiple of 128"): those calls take SDPA.
    import shared.model.model as model

    calls = []

    def recording(q, k, v):
        calls.append(q.shape[-2])
        return sdpa_causal(q, k, v)

    monkeypatch.setattr(xla_runtime, "tpu_generation", TPU_GENERATIONS["v5e"])
    monkeypatch.setattr(attention_select, "splash_attention_kernel", lambda mesh, instead: recording)
    monkeypatch.setattr(attention_select, "flash_attention_kernel", lambda mesh: sdpa_causal)
    chosen = xla_runtime.select_attention(*SHAPE)
    assert chosen.kind == "pallas-splash" and calls == [256] * 2  # its probe: with gradients, without
    q, k, v = (torch.randn(2, 2, 192, 64) for _ in range(3))
    out = model.causal_attention(q, k, v, chosen)
    assert calls == [256] * 2
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    q, k, v = (torch.randn(2, 2, 256, 64) for _ in range(3))
    model.causal_attention(q, k, v, chosen)
    assert calls == [256] * 3


def test_a_torchax_or_jax_that_breaks_on_import_is_a_notice_and_flash_is_tried(xla_runtime, monkeypatch, capsys):
    def broken(timeout_s, fn):
        raise AttributeError("module 'jax.experimental' has no attribute 'shard_map'")

    monkeypatch.setattr(attention_select, "within", broken)
    assert attention_select.splash_attention_kernel(xla_runtime.mesh) is None
    assert capsys.readouterr().out == (
        "notice: importing jax's splash attention gave AttributeError: module 'jax.experimental' has no attribute "
        "'shard_map'; trying the flash-attention kernel\n")


@pytest.mark.slow
def test_training_with_splash_compiles_nothing_after_step_two_and_follows_sdpas_losses(demo_data, tmp_path,
                                                                                       monkeypatch):
    # The whole trainer with splash as a session installs it (the projections made sequence-minor, the backward
    # from the forward's residuals), the kernel run by Pallas's interpreter on the 8 XLA CPU devices.
    from helpers import small_config, train_in_process

    from shared.model.attention import SPLASH, kernel_choice
    from shared.runtime.device import make_runtime
    from shared.train.metrics import read_metrics

    splash = kernel_choice(SPLASH, splash_attention(make_runtime("xla").mesh, interpret=True), 128)
    losses = {}
    for attention in ("splash", "sdpa"):
        out = tmp_path / attention
        cfg = small_config(demo_data, out, seq_len=128, micro_batch=8, total_batch_tokens=2048, total_steps=5)
        result, _ = train_in_process(cfg, attention=splash if attention == "splash" else None)
        assert result.step == 5
        records = {r["step"]: r for r in read_metrics(out / "metrics.jsonl") if "loss" in r}
        assert records[5]["compiles"] == records[2]["compiles"], attention
        losses[attention] = [records[s]["loss"] for s in range(1, 6)]
    assert losses["splash"] == pytest.approx(losses["sdpa"], rel=2e-3)  # bf16 autocast: rounding apart
    assert losses["splash"][-1] < losses["splash"][0]
