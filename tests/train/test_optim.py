"""Muon (with AdamW for the rest) and the schedules: the update against a direct float64 computation, the AdamW
part against torch's AdamW, the schedule's values; under XLA: nothing compiles after step 2, fsdp trains the same
model, and a resumed run is bit-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_identical_runs, loss_history, small_config, train_cli, train_config, train_in_process

from shared.config import OptimizerSettings, TrainConfig
from shared.errors import UserError
from shared.model.model import GPT
from shared.runtime.optim import (
    NS_COEFFICIENTS,
    MuonAdamW,
    clip_grad_norm,
    lr_at,
    make_optimizer,
    muon_matrix_shape,
    newton_schulz,
    optimizer_tensors,
    same_schedule_until,
    stable_phase_end,
)
from shared.runtime.runtime import Runtime
from shared.train.metrics import read_metrics

MUON = ("--optimizer", "muon", "--schedule", "wsd", "--lr", "3e-3", "--muon-lr", "0.03")


def reference_orthogonalise(g: np.ndarray, steps: int = 5) -> np.ndarray:
    """The quintic Newton-Schulz iteration, written out in float64 numpy for one matrix."""
    a, b, c = NS_COEFFICIENTS
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / (np.linalg.norm(x) + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


def reference_muon_steps(w0: np.ndarray, grads: list[np.ndarray], lrs: list[float], momentum: float, wd: float,
                         blocks: int = 1, scale: str = "shape") -> np.ndarray:
    """Muon by its definition: m = mu m + (1 - mu) g; u = (1 - mu) g + mu m (Nesterov); each of `blocks` row
    blocks orthogonalised, scaled by sqrt(max(1, rows/cols)) (KellerJordan/Muon muon.py:40) or, as the speedrun's
    2024-10-10 record does, sqrt(max(rows, cols)) (its train_gpt2.py:98-101); w = w (1 - lr wd) - lr u."""
    w, m = w0.astype(np.float64), np.zeros_like(w0, dtype=np.float64)
    for g, lr in zip(grads, lrs, strict=True):
        g = g.astype(np.float64)
        m = momentum * m + (1 - momentum) * g
        u = (1 - momentum) * g + momentum * m
        parts = np.split(u, blocks, axis=0)
        factor = (lambda r, c: max(1.0, r / c) ** 0.5) if scale == "shape" else (lambda r, c: max(r, c) ** 0.5)
        ortho = np.concatenate([reference_orthogonalise(p) * factor(*p.shape) for p in parts], axis=0)
        w = w * (1 - lr * wd) - lr * ortho
    return w


def test_newton_schulz_keeps_the_singular_vectors_and_flattens_the_spectrum():
    g = torch.randn(24, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    g[:, :3] *= 50.0  # an ill-conditioned matrix: singular values spread over two orders of magnitude
    for matrix in (g, g.T):  # wide and tall
        u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
        assert s.max() / s.min() > 20
        ortho = newton_schulz(matrix.float(), dtype=torch.float32).double()
        core = u.T @ ortho @ vh.T  # diagonal if ortho = U S' V^T
        off = core - torch.diag(torch.diagonal(core))
        assert off.abs().max() < 1e-4
        assert torch.diagonal(core).min() > 0.5 and torch.diagonal(core).max() < 1.5
        assert np.allclose(ortho.numpy(), reference_orthogonalise(matrix.numpy()), atol=2e-5)
    # bf16 (what accelerators compute in) stays near the float64 result
    bf16 = newton_schulz(g.float(), dtype=torch.bfloat16).double()
    assert (bf16 - torch.from_numpy(reference_orthogonalise(g.numpy()))).abs().max() < 0.05


@pytest.mark.parametrize("scale, muon_lr", [("shape", 0.05), ("max_dim", 0.004)])
def test_muon_update_matches_a_direct_computation(scale, muon_lr):
    cfg = train_config(preset="tiny", optimizer="muon", lr=1e-3, muon_lr=muon_lr, muon_momentum=0.9,
                       muon_weight_decay=0.1, weight_decay=0.0, muon_scale=scale)
    torch.manual_seed(0)
    model = GPT(cfg.model.shape)
    named = list(model.named_parameters())
    params = dict(named)
    lr = torch.tensor(cfg.optim.lr)
    opt = make_optimizer(named, cfg.optim, Runtime("cpu"), lr)
    watched = {"transformer.h.0.mlp.c_fc.weight": 1, "transformer.h.1.attn.c_proj.weight": 1,
               "transformer.h.0.mlp.c_proj.weight": 1, "transformer.h.1.attn.c_attn.weight": 3}
    start = {name: params[name].detach().numpy().copy() for name in watched}
    grads: dict[str, list[np.ndarray]] = {name: [] for name in watched}
    lrs = [1e-3, 5e-4, 2e-4]
    gen = torch.Generator().manual_seed(1)
    for step_lr in lrs:
        lr.fill_(step_lr)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        for name in watched:
            grads[name].append(params[name].grad.numpy().copy())
        opt.step()
    for name, blocks in watched.items():
        expected = reference_muon_steps(start[name], grads[name], [x * muon_lr / cfg.optim.lr for x in lrs], 0.9, 0.1,
                                        blocks, scale)
        assert np.allclose(params[name].detach().numpy(), expected, atol=2e-5), name
    if scale == "max_dim":  # every matrix, whatever its shape, moved by about muon_lr x the schedule RMS a step
        for name in watched:
            first = reference_muon_steps(start[name], grads[name][:1], [muon_lr], 0.9, 0.0, watched[name], scale)
            assert 0.6 * muon_lr < np.sqrt(np.mean((first - start[name]) ** 2)) < 1.3 * muon_lr, name
    # c_attn is three matrices: orthogonalising it whole would give another update
    whole = reference_muon_steps(start["transformer.h.1.attn.c_attn.weight"],
                                 grads["transformer.h.1.attn.c_attn.weight"], [x * muon_lr / cfg.optim.lr for x in lrs],
                                 0.9, 0.1, 1, scale)
    assert not np.allclose(params["transformer.h.1.attn.c_attn.weight"].detach().numpy(), whole, atol=1e-3)
    state = optimizer_tensors(opt, named)
    assert set(state) == {f"{n}.momentum_buffer" for n, p in named if muon_matrix_shape(n, p)} | {
        f"{n}.{k}" for n, p in named if not muon_matrix_shape(n, p) for k in ("exp_avg", "exp_avg_sq", "step")}


def test_muon_orthogonalises_each_shape_of_matrix_once_a_step_as_a_batch(monkeypatch):
    """Under XLA every op of the update is traced from Python each step: the matrices of one shape (one a layer)
    go through Newton-Schulz as one batch, so tiny's 8 matrices (4 shapes x 2 layers) take 4 calls, not 8."""
    import shared.runtime.optim as optim

    batches = []
    real = optim.newton_schulz
    monkeypatch.setattr(optim, "newton_schulz", lambda x, **kw: batches.append(tuple(x.shape)) or real(x, **kw))
    cfg = train_config(preset="tiny", optimizer="muon")
    model = GPT(cfg.model.shape)
    named = list(model.named_parameters())
    opt = make_optimizer(named, cfg.optim, Runtime("cpu"), torch.tensor(cfg.optim.lr))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    c = cfg.model.shape.n_embd
    assert sorted(batches) == sorted([(2, 3, c, c), (2, c, c), (2, 4 * c, c), (2, c, 4 * c)])


@pytest.mark.parametrize("aux_lr", [0.0, 5e-4])
def test_muon_leaves_embeddings_biases_and_gains_to_adamw_as_torch_computes_it(aux_lr):
    """AdamW for the rest, at --lr; with --aux-lr the position embedding, biases and gains at that instead, the
    token embedding (the tied head) still at --lr."""
    cfg = train_config(preset="tiny", optimizer="muon", lr=2e-3, weight_decay=0.1, aux_lr=aux_lr)
    torch.manual_seed(0)
    model, twin = GPT(cfg.model.shape), GPT(cfg.model.shape)
    twin.load_state_dict(model.state_dict())
    named = list(model.named_parameters())
    opt = make_optimizer(named, cfg.optim, Runtime("cpu"), torch.tensor(cfg.optim.lr))
    adam_names = [n for n, p in named if not muon_matrix_shape(n, p)]
    assert "transformer.wte.weight" in adam_names and "transformer.h.0.ln_1.weight" in adam_names
    assert "transformer.h.0.attn.c_attn.bias" in adam_names and "transformer.h.0.mlp.c_fc.weight" not in adam_names
    twin_params = dict(twin.named_parameters())
    rest = aux_lr or cfg.optim.lr
    reference = torch.optim.AdamW(
        [{"params": [twin_params["transformer.wte.weight"]], "weight_decay": 0.1},
         {"params": [twin_params[n] for n in adam_names if twin_params[n].dim() >= 2 and "wte" not in n],
          "weight_decay": 0.1, "lr": rest},
         {"params": [twin_params[n] for n in adam_names if twin_params[n].dim() < 2], "weight_decay": 0.0,
          "lr": rest}],
        lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        for (name, p) in named:
            p.grad = torch.randn(p.shape, generator=gen)
            twin_params[name].grad = p.grad.clone()
        opt.step()
        reference.step()
    mine = dict(named)
    for name in adam_names:
        assert torch.allclose(mine[name], twin_params[name], atol=1e-6, rtol=1e-5), name


def test_adamw_with_a_matrix_lr_is_torchs_adamw_with_muons_groups():
    """--matrix-lr (the bench's AdamW control): the blocks' matrices at their own LR, everything else at --lr, both
    following the schedule's tensor; the reference is torch's AdamW with those groups and LRs."""
    cfg = train_config(preset="tiny", optimizer="adamw", lr=4e-3, matrix_lr=1e-3, weight_decay=0.1)
    torch.manual_seed(0)
    model, twin = GPT(cfg.model.shape), GPT(cfg.model.shape)
    twin.load_state_dict(model.state_dict())
    named = list(model.named_parameters())
    lr = torch.tensor(cfg.optim.lr)
    opt = make_optimizer(named, cfg.optim, Runtime("cpu"), lr)
    matrices = {n for n, p in named if muon_matrix_shape(n, p)}
    twin_params = dict(twin.named_parameters())
    reference = torch.optim.AdamW(
        [{"params": [twin_params[n] for n in sorted(matrices)], "weight_decay": 0.1, "lr": 1e-3},
         {"params": [p for n, p in twin_params.items() if n not in matrices and p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for n, p in twin_params.items() if n not in matrices and p.dim() < 2], "weight_decay": 0.0}],
        lr=cfg.optim.lr, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(2)
    for scale in (1.0, 0.5, 0.25):  # the schedule moves the shared tensor; every group follows it
        lr.fill_(cfg.optim.lr * scale)
        for group in reference.param_groups:
            group["lr"] = (1e-3 if group is reference.param_groups[0] else cfg.optim.lr) * scale
        for name, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
            twin_params[name].grad = p.grad.clone()
        opt.step()
        reference.step()
    mine = dict(named)
    for name in mine:
        assert torch.allclose(mine[name], twin_params[name], atol=1e-6, rtol=1e-5), name
    assert set(optimizer_tensors(opt, named)) == {f"{n}.{k}" for n, _ in named for k in ("exp_avg", "exp_avg_sq",
                                                                                         "step")}
    with pytest.raises(UserError, match=r"^--matrix-lr is AdamW's; Muon's matrices take --muon-lr"):
        train_config(optimizer="muon", matrix_lr=1e-3)


def test_wsd_schedule_warms_up_holds_then_decays_to_zero():
    cfg = train_config(schedule="wsd", lr=1e-3, warmup_steps=10, total_steps=100, cooldown_frac=0.4)
    lrs = [float(lr_at(torch.tensor(float(s)), cfg.optim, cfg.lr_schedule)) for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert lrs[10:61] == [pytest.approx(1e-3)] * 51  # constant until 60% of the run
    assert lrs[80] == pytest.approx(1e-3 * 20 / 40) and lrs[99] == pytest.approx(1e-3 / 40)
    assert float(lr_at(torch.tensor(100.0), cfg.optim, cfg.lr_schedule)) == 0.0
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    cosine = cfg.replace(schedule="cosine", min_lr_ratio=0.1)
    assert float(lr_at(torch.tensor(100.0), cosine.optim, cosine.lr_schedule)) == pytest.approx(1e-4)


def test_a_one_minus_sqrt_cooldown_follows_epfls_sqrt_decay_and_ends_its_stable_phase_where_linear_does():
    """epfml/schedules-and-scaling src/optim/utils.py (decay_type "sqrt"): 1 - sqrt((step - n_hold) / n_anneal)."""
    cfg = train_config(schedule="wsd", lr=1e-3, warmup_steps=10, total_steps=100, cooldown_frac=0.4,
                       cooldown_shape="1-sqrt")
    n_hold, n_anneal = 60, 40
    lr = {s: float(lr_at(torch.tensor(float(s)), cfg.optim, cfg.lr_schedule)) for s in (9, 60, 61, 70, 85, 99, 100)}
    for step in (60, 61, 70, 85, 99):
        expected = 1e-3 * (1 - ((step - n_hold) / n_anneal) ** 0.5)
        assert lr[step] == pytest.approx(expected, rel=1e-5), step
    assert lr[70] == pytest.approx(5e-4)  # a quarter of the way: half the LR
    assert lr[100] == 0.0
    assert lr[9] == pytest.approx(1e-3)
    assert stable_phase_end(cfg) == stable_phase_end(cfg.replace(cooldown_shape="linear")) == 61
    assert not same_schedule_until(cfg, cfg.replace(cooldown_shape="linear"), 62)
    with pytest.raises(UserError, match="--cooldown-shape must be linear or 1-sqrt, got 'cosine'"):
        cfg.replace(cooldown_shape="cosine")


def test_a_zero_clip_measures_the_gradient_norm_and_leaves_the_gradients_alone():
    params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    grads = [torch.full((3, 4), 2.0), torch.full((5,), -1.0)]
    norm = (12 * 4.0 + 5 * 1.0) ** 0.5
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    assert float(clip_grad_norm(params, 0.0)) == pytest.approx(norm)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    assert float(clip_grad_norm(params, 1.0)) == pytest.approx(norm)
    total = sum(float(p.grad.square().sum()) for p in params) ** 0.5
    assert total == pytest.approx(1.0, rel=1e-4)
    with pytest.raises(UserError, match="--grad-clip must be >= 0, got -1.0"):
        train_config(grad_clip=-1.0)


def test_bad_optimizer_and_schedule_flags_are_one_line_errors():
    with pytest.raises(UserError, match="--optimizer must be adamw or muon, got 'sgd'"):
        train_config(optimizer="sgd").validate()
    with pytest.raises(UserError, match="--schedule must be cosine or wsd, got 'linear'"):
        train_config(schedule="linear").validate()
    with pytest.raises(UserError, match=r"--cooldown-frac must be in \(0, 1\], got 1.5"):
        train_config(cooldown_frac=1.5).validate()


# --- under XLA (8 CPU devices, SPMD) ----------------------------------------------------------------------------

@pytest.mark.slow
def test_muon_compiles_nothing_after_step_two(demo_data, tmp_path):
    # with the momentum warming up (a device tensor moved every step) and zero-initialised projections
    cfg = small_config(demo_data, tmp_path, total_steps=8, warmup_steps=2, optimizer="muon", schedule="wsd",
                       lr=3e-3, muon_lr=0.03, checkpoint_every=3, muon_momentum_warmup_steps=4,
                       zero_init_projections=True)
    result, _ = train_in_process(cfg)
    assert result.step == 8
    records = {r["step"]: r for r in read_metrics(tmp_path / "metrics.jsonl") if "loss" in r}
    assert records[8]["compiles"] == records[2]["compiles"]
    for s in (5, 8):  # plain steps: the step's one graph (the accumulation loop inside), one token transfer
        assert records[s]["graphs"] - records[s - 1]["graphs"] == 1
        assert records[s]["h2d_transfers"] - records[s - 1]["h2d_transfers"] == 1
    lrs = [records[s]["lr"] for s in range(1, 9)]
    assert lrs[1:5] == [pytest.approx(3e-3)] * 4 and lrs[7] < lrs[6] < lrs[5] < 3e-3  # held, then decaying
    losses = [records[s]["loss"] for s in range(1, 9)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5


@pytest.mark.slow
def test_muon_under_fsdp_steps_as_replicated(demo_data, tmp_path):
    """Under fsdp each matrix is sharded over the 8 devices and Muon orthogonalises the gathered whole: one step
    from the same gradients gives the replicated run's parameters (float32 Newton-Schulz: to rounding; bf16
    differs by its rounding only), and a short fsdp training run follows the replicated one."""
    from shared.runtime.device import make_runtime

    runtime = make_runtime("xla")
    cfg = train_config(preset="tiny", optimizer="muon", lr=1e-3, muon_lr=0.05)
    after = {}
    for fsdp in (False, True):
        torch.manual_seed(0)
        model = GPT(cfg.model.shape)
        runtime.prepare_model(model, fsdp=fsdp)
        named = list(model.named_parameters())
        opt = make_optimizer(named, cfg.optim, runtime, torch.tensor(cfg.optim.lr).to(runtime.device))
        opt.ns_dtype = torch.float32
        gen = torch.Generator().manual_seed(1)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen).to(runtime.device)
            runtime.shard_like(p.grad, p)
        opt.step()
        runtime.sync()
        after[fsdp] = {n: p.detach().cpu() for n, p in named}
    runtime._fsdp = False
    for name in after[False]:
        assert torch.allclose(after[True][name], after[False][name], atol=1e-6), name
    muon = {"optimizer": "muon", "schedule": "wsd", "lr": 3e-3, "muon_lr": 0.03, "total_steps": 3}
    train_in_process(small_config(demo_data, tmp_path / "fsdp", fsdp=True, **muon))
    train_in_process(small_config(demo_data, tmp_path / "dp", **muon))
    a, b = loss_history(tmp_path / "fsdp"), loss_history(tmp_path / "dp")
    assert len(a) == 3 and np.allclose([h[1] for h in a], [h[1] for h in b], atol=5e-3)


@pytest.mark.slow
def test_muon_resume_in_new_process_is_bit_exact(demo_data, tmp_path):
    straight = train_cli(demo_data, tmp_path / "straight", *MUON, "--total-steps", "6")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = train_cli(demo_data, tmp_path / "resumed", *MUON, "--total-steps", "6", "--stop-after-steps", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = train_cli(demo_data, tmp_path / "resumed", *MUON, "--total-steps", "6")
    assert second.returncode == 0 and "resuming at step 3" in second.stdout, second.stderr[-3000:]
    assert_identical_runs(tmp_path / "straight", tmp_path / "resumed", 6)
    # the checkpoint holds Muon's state; resuming it as AdamW is refused in one line, nothing written
    with pytest.raises(UserError, match=r"^--optimizer adamw: the checkpoint .* holds muon's state; resume with "
                                        r"--optimizer muon"):
        train_in_process(small_config(demo_data, tmp_path / "resumed", total_steps=9))
    assert [h[0] for h in loss_history(tmp_path / "resumed")] == list(range(1, 7))


def load_recipe():
    from helpers import REPO

    from scripts.chain.config import load_config

    return load_config(REPO / "examples" / "chain-gpt2-124m-muon.json")


def test_one_session_recipe_config_is_muon_filling_its_session_with_full_hellaswag():
    chain = load_recipe()
    cfg = TrainConfig.from_dict({**chain.train.settings, "total_steps": chain.total_steps})
    cfg.validate(8)
    tokens = chain.total_steps * cfg.step.total_batch_tokens
    assert cfg.optim.optimizer == "muon" and cfg.lr_schedule.schedule == "wsd" and cfg.model.preset == "gpt2"
    # Filled to 85% of the session once --smoke measured the TPU, up to two passes over sample-10BT's two parts
    # (tests/chain/test_fill.py); unmeasured it trains 7.0B tokens, within one pass of them.
    assert chain.fill_session >= 0.8 and chain.fill_passes == 2
    parts, per_part = chain.tokenize.parts, chain.tokenize.settings["tokens_per_part"]
    assert (parts, per_part) == (2, 5_000_000_000)
    assert 7.0e9 <= tokens < 7.01e9 and tokens <= parts * per_part - 100_000_000
    # all 10,042
    assert (cfg.evals.hellaswag_examples, cfg.evals.hellaswag_every, cfg.evals.eval_every) == (0, 1000, 250)
    assert chain.session_limit_s == 9 * 3600 and chain.accelerator == "TpuV5E8"
    # the 2024-10-10 Muon record's settings, one source for all (docs/recipe.md section 1), but two that
    # scripts/bench_recipe_arms.py chose for this architecture (docs/recipe.md section 4): the position embedding,
    # biases and gains at 6e-4 (the tied embedding keeps the record's 0.0036), and the gradient clip at 1.0
    o, s = cfg.optim, cfg.lr_schedule
    assert (o.muon_scale, o.muon_lr, o.lr, o.aux_lr, o.muon_momentum, o.muon_momentum_warmup_steps, o.muon_weight_decay,
            o.weight_decay, o.grad_clip, s.warmup_steps, s.cooldown_frac, s.cooldown_shape) == (
        "max_dim", 0.00036, 0.0036, 0.0006, 0.95, 0, 0.0, 0.0, 1.0, 0, 0.29, "linear")


def test_bench_recipe_remaps_to_the_most_frequent_tokens_and_reads_tokens_needed(tmp_path):
    import importlib.util

    from helpers import REPO

    from shared.data import read_shard, write_shard

    spec = importlib.util.spec_from_file_location("bench_recipe", REPO / "scripts" / "bench_recipe.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shard(corpus / "c_train_000000.bin", np.array([7, 7, 7, 900, 900, 5, 60000, 7], dtype=np.uint16))
    write_shard(corpus / "c_val_000000.bin", np.array([5, 900, 7, 12], dtype=np.uint16))
    out = bench.remap_vocabulary(corpus, vocab=3)
    assert out == tmp_path / "corpus-vocab3"
    # 7 (4 times) -> 0, 900 (twice) -> 1, everything else -> the shared id 2; validation uses the train ranks
    assert read_shard(out / "c_train_000000.bin").tolist() == [0, 0, 0, 1, 1, 2, 2, 0]
    assert read_shard(out / "c_val_000000.bin").tolist() == [2, 1, 0, 2]
    finals = [(1_000_000, 3.0), (2_000_000, 2.5), (4_000_000, 2.0)]
    needed, interpolated = bench.tokens_to_reach(2.25, finals)  # halfway in log(tokens) from 2M to 4M
    assert interpolated and needed == pytest.approx(2_000_000 * 2 ** 0.5)
    assert bench.tokens_to_reach(3.5, finals) == (1_000_000, False)  # the smallest budget already reaches it
    assert bench.tokens_to_reach(1.0, finals) == (None, False)
    # seeds: the mean curve with its min-max band, and the table's mean ± sd (min-max)
    seeds = [[(0, 5.0), (10, 4.0)], [(0, 5.2), (10, 3.0)], [(0, 4.8), (10, 3.5)]]
    assert bench.mean_curve(seeds) == [(0, pytest.approx(5.0), 4.8, 5.2), (10, pytest.approx(3.5), 3.0, 4.0)]
    assert bench.spread([3.0, 3.5, 4.0]) == "3.5000 ± 0.5000 (3.0000–4.0000)"
    # --compare: the record's settings are the recipe's (at the recipe's AdamW LR), and "before issue 32" at gpt2's
    # width and length is the recipe as it was (muon_lr 0.02 in the Muon README's convention, 100/300 warm-ups)
    compared = bench.compared_settings(0.0036, 768, 13352)
    chain = TrainConfig.from_dict({k: v for k, v in load_recipe().train.settings.items() if k in compared["record"]})
    settings = {k: v for section in chain.to_dict().values() for k, v in section.items()}
    assert all(settings[k] == pytest.approx(v) for k, v in compared["record"].items() if k != "grad_clip")
    assert (compared["record"]["grad_clip"], chain.optim.grad_clip) == (0.0, 1.0)  # the record clips nothing; ours does
    before = compared["before-issue-32"]
    assert before["muon_lr"] == pytest.approx(0.02, rel=0.01) and before["muon_scale"] == "shape"
    assert (before["warmup_steps"], before["muon_momentum_warmup_steps"], before["cooldown_frac"]) == (100, 300, 0.4)
    assert compared["record-lr-double"]["muon_lr"] == pytest.approx(0.00072)


def test_muon_momentum_warms_up_linearly_then_holds():
    from shared.runtime.optim import muon_momentum_at

    cfg = train_config(optimizer="muon", muon_momentum_warmup_steps=300)
    steps = torch.tensor([0.0, 150.0, 299.0, 300.0, 5000.0])
    expected = [0.85 + 0.10 * min(s / 300, 1.0) for s in steps.tolist()]  # the records' 0.85 -> 0.95 over 300
    assert muon_momentum_at(steps, cfg.optim).tolist() == pytest.approx(expected, abs=1e-7)
    assert muon_momentum_at(torch.tensor(7.0), OptimizerSettings(optimizer="muon")).item() == pytest.approx(0.95)
    with pytest.raises(UserError, match="--muon-momentum-start must be in"):
        train_config(muon_momentum_start=1.0)


def _two_muon_steps(momenta: list, as_tensor: bool) -> torch.Tensor:
    """A 16 x 8 matrix after two Muon steps with the given momentum at each (fp32 Newton-Schulz, fixed grads)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(16, 8))
    momentum = torch.tensor(momenta[0]) if as_tensor else momenta[0]
    group = {"params": [weight], "kind": "muon", "lr_ratio": 1.0, "weight_decay": 0.01, "momentum": momentum,
             "scale": "shape", "shapes": {id(weight): (16, 8)}}
    opt = MuonAdamW([group], torch.tensor(0.02), ns_dtype=torch.float32)
    opt.state[weight]["momentum_buffer"] = torch.zeros(16, 8)
    for m, seed in zip(momenta, (1, 2), strict=True):
        if as_tensor:
            momentum.copy_(torch.tensor(m))
        else:
            opt.param_groups[0]["momentum"] = m
        weight.grad = torch.randn(16, 8, generator=torch.Generator().manual_seed(seed))
        opt.step()
    return weight.detach().clone()


def test_a_momentum_tensor_moved_between_steps_steps_as_the_constants_would():
    moved = _two_muon_steps([0.85, 0.9], as_tensor=True)
    # equal to float32 rounding (1 - m is formed in float32 from the tensor, in float64 from the constant)
    torch.testing.assert_close(moved, _two_muon_steps([0.85, 0.9], as_tensor=False), rtol=0, atol=1e-6)
    assert (moved - _two_muon_steps([0.95, 0.95], as_tensor=False)).abs().max() > 1e-4


def test_zero_initialised_projections_start_each_block_as_the_identity_and_still_learn():
    from shared.eval.hf import to_hf_state_dict
    from shared.model_shape import MODEL_PRESETS

    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["tiny"])
    keys = set(to_hf_state_dict(model))
    model.zero_output_projections()
    projections = [m for b in model.transformer.h for m in (b.attn.c_proj, b.mlp.c_proj)]
    assert len(projections) == 4 and all(not p.weight.any() and not p.bias.any() for p in projections)
    x = torch.randint(0, 100, (2, 16))
    block_in = model.transformer.wte(x) + model.transformer.wpe(torch.arange(16))
    assert torch.equal(model.transformer.h[0](block_in), block_in)  # zero outputs: the residual passes through
    _, loss = model(x, x)
    loss.backward()
    assert all(p.weight.grad.abs().sum() > 0 for p in projections)
    assert set(to_hf_state_dict(model)) == keys  # the export's layout is unchanged
    assert train_config(zero_init_projections=True).model.zero_init_projections


# --- the stable phase and --extend ---------------------------------------------------------------------------

@pytest.mark.parametrize("total_steps, cooldown_frac, warmup, expected", [
    (8, 0.5, 2, 5),  # the LR is held through step 4 ((8 - 4) / 4 = 1), decays from step 5
    (19073, 0.4, 715, 11444),  # 19073 x 0.6 = 11443.8: step 11443 is the last held
    (10, 0.3, 2, 8),  # 10 x 0.7 = 7: held through step 7 ((10 - 7) / 3 = 1)
    (8, 1.0, 2, 1),  # decays from the start: only the first warm-up step agrees with a longer run
])
def test_the_stable_phase_ends_where_the_first_update_is_decayed(total_steps, cooldown_frac, warmup, expected):
    cfg = train_config(schedule="wsd", lr=6e-4, total_steps=total_steps, cooldown_frac=cooldown_frac,
                       warmup_steps=warmup)
    assert stable_phase_end(cfg) == expected
    # directly: every update before it is made at the peak (or the warm-up's rate), the one at it below the peak
    lrs = [6e-4 * min((s + 1) / warmup, 1.0, (total_steps - s) / (cooldown_frac * total_steps))
           for s in range(total_steps)]
    held = [6e-4 * min((s + 1) / warmup, 1.0) for s in range(total_steps)]
    assert lrs[:expected] == pytest.approx(held[:expected]) and lrs[expected] < held[expected] * (1 - 1e-6)
    assert stable_phase_end(cfg.replace(schedule="cosine")) is None


def test_a_longer_wsd_schedule_agrees_with_a_shorter_one_until_its_stable_phase_ends():
    short = train_config(schedule="wsd", total_steps=8, cooldown_frac=0.5, warmup_steps=2, optimizer="muon",
                         muon_momentum_warmup_steps=3)
    longer = short.replace(total_steps=12)
    assert same_schedule_until(short, longer, 5) and not same_schedule_until(short, longer, 6)
    assert not same_schedule_until(short, longer.replace(muon_lr=0.01), 1)
    assert not same_schedule_until(short, longer.replace(muon_momentum_start=0.9), 1)
    cosine = short.replace(schedule="cosine")
    # cosine depends on total_steps from the first step after its peak (step 2 here)
    assert same_schedule_until(cosine, cosine.replace(total_steps=12), 3)
    assert not same_schedule_until(cosine, cosine.replace(total_steps=12), 4)
    with pytest.raises(UserError, match=r"^--extend needs --schedule wsd"):
        cosine.replace(extend=True)
