"""The model: GPT-2 init, tied embeddings, and exact agreement with Hugging Face's GPT2LMHeadModel."""

import copy
import math

import pytest
import torch

from shared.eval.hf import export_hf, load_hf
from shared.model.model import GPT
from shared.model_shape import GPT2_VOCAB_SIZE, MODEL_PRESETS, PADDED_VOCAB_SIZE, ModelConfig

transformers = pytest.importorskip("transformers")

SMALL = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)


def _expected_params(cfg: ModelConfig, vocab: int) -> int:
    per_block = 12 * cfg.n_embd**2 + 13 * cfg.n_embd  # attention 4C^2+4C, MLP 8C^2+5C, two LayerNorms 4C
    return vocab * cfg.n_embd + cfg.block_size * cfg.n_embd + cfg.n_layer * per_block + 2 * cfg.n_embd


def test_presets_match_gpt2_sizes():
    # OpenAI's GPT-2 124M has 124,439,808 parameters with its 50257-token vocabulary.
    assert _expected_params(MODEL_PRESETS["gpt2"], GPT2_VOCAB_SIZE) == 124_439_808
    assert _expected_params(MODEL_PRESETS["gpt2-xl"], GPT2_VOCAB_SIZE) == 1_557_611_200
    tiny_cfg = MODEL_PRESETS["tiny"]
    assert GPT(tiny_cfg).num_params() == _expected_params(tiny_cfg, PADDED_VOCAB_SIZE)


def test_gpt2_init_and_tied_embeddings():
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=4, n_head=4, n_embd=256, block_size=64)
    model = GPT(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert model.transformer.h[0].attn.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.transformer.h[0].mlp.c_proj.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert model.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.count_nonzero(model.transformer.h[0].attn.c_attn.bias) == 0
    # Moving the model (as to an XLA device) must keep the tie.
    moved = model.to(torch.float64)
    assert moved.lm_head.weight is moved.transformer.wte.weight


def test_logits_cover_real_vocabulary_and_loss_matches_manual():
    torch.manual_seed(0)
    model = GPT(SMALL)
    with torch.no_grad():  # make the padded columns matter: a slicing bug would show in the loss
        model.transformer.wte.weight[GPT2_VOCAB_SIZE:] = 1.0
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 16))
    logits, _ = model(idx[:, :-1])
    assert logits.shape == (2, 15, GPT2_VOCAB_SIZE)
    no_logits, loss = model(idx[:, :-1], idx[:, 1:])
    assert no_logits is None  # with targets only the loss is returned (no logits kept alive in the step)
    manual = torch.nn.functional.cross_entropy(logits.reshape(-1, GPT2_VOCAB_SIZE), idx[:, 1:].reshape(-1))
    assert loss.item() == pytest.approx(manual.item(), abs=1e-6)
    # The padded columns get no gradient: they are masked out of the softmax, not merely never targeted.
    loss.backward()
    assert torch.count_nonzero(model.transformer.wte.weight.grad[GPT2_VOCAB_SIZE:]) == 0


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 17))
    _, plain_loss = model(idx[:, :-1], idx[:, 1:])
    plain_loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    calls = []

    def checkpoint(block, x):
        calls.append(block)
        return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)

    model.block_checkpoint = checkpoint
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert len(calls) == SMALL.n_layer  # every block went through the checkpoint
    assert loss.item() == plain_loss.item()
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, plain_grads[name], atol=1e-7), name


@pytest.mark.parametrize("layout", ["BHTD", "BHDT"])
def test_for_a_kernels_layout_the_attention_makes_q_k_v_by_einsum_with_the_same_loss_and_gradients(layout):
    from shared.model.attention import AttentionChoice

    seen = []

    def kernel(q, k, v):
        seen.append((q.dtype, k.dtype, v.dtype))  # the matmul's dtype: an fp32 bias must not promote them
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch.manual_seed(0)
    model = GPT(SMALL, AttentionChoice("pallas-flash", kernel, 24, layout))  # the model given the kernel
    plain = GPT(SMALL)  # SDPA, by default
    with torch.no_grad():  # biases off zero (GPT-2's init), so a wrong bias view shows in the forward too
        for block in model.transformer.h:
            block.attn.c_attn.bias.normal_()
            block.attn.c_proj.bias.normal_()
    idx = torch.randint(0, GPT2_VOCAB_SIZE, (2, 25))  # T = 24, not D = 16: a swapped (T, D) fails to broadcast
    plain.load_state_dict(model.state_dict())  # the same weights
    _, plain_loss = plain(idx[:, :-1], idx[:, 1:])
    plain_loss.backward()
    plain_grads = {n: p.grad.clone() for n, p in plain.named_parameters()}
    assert seen == []
    linear_calls = []  # this path makes q, k, v by einsum over c_attn's weight, not by calling c_attn
    for block in model.transformer.h:
        block.attn.c_attn.register_forward_hook(lambda *_: linear_calls.append(1))
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx[:, :-1], idx[:, 1:])
    assert linear_calls == []
    model(idx[:, :8], idx[:, 1:9])  # another length: SDPA, the projections as nn.Linear makes them
    assert plain.attention.kernel is None and all(b.attn.attention.kernel is None for b in plain.transformer.h)
    assert len(linear_calls) == SMALL.n_layer
    assert seen == [(torch.float32,) * 3] * SMALL.n_layer + [(torch.bfloat16,) * 3] * SMALL.n_layer
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-6)
    for name, p in model.named_parameters():
        assert torch.allclose(p.grad, plain_grads[name], rtol=1e-5, atol=1e-7), name


@pytest.mark.parametrize("columns", [True, False])
def test_the_token_lookups_gradient_kept_apart_adds_up_to_the_tied_weights_gradient(columns):
    # Inside embedding_grad_apart the token lookup's gradient goes to a leaf of its own, and wte.weight.grad
    # keeps only the tied head's. Checked against the same model untied (the head a copy of wte, its own
    # Parameter), where autograd itself gives the two parts apart; and the two add up to the tied gradient.
    # Scattered into (C, V) columns and transposed (a TPU's form) or straight into rows (XLA:CPU's): the same.
    torch.manual_seed(0)
    model = GPT(SMALL)
    idx = torch.randint(0, 40, (3, 17))  # a small range of token ids: many repeats
    _, plain_loss = model(idx[:, :-1], idx[:, 1:])
    plain_loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(untied.transformer.wte.weight.detach().clone())
    untied.zero_grad()
    untied(idx[:, :-1], idx[:, 1:])[1].backward()
    model.zero_grad()
    with model.embedding_grad_apart(columns=columns) as (weight, apart):
        assert weight is model.transformer.wte.weight and apart.shape == weight.shape
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
    assert model._embedding_grad_apart is None and model._lookup_grad_columns  # outside, the plain lookup again
    assert loss.item() == plain_loss.item()
    assert torch.allclose(apart.grad, untied.transformer.wte.weight.grad, atol=1e-7)
    assert apart.grad[40:].abs().max() == 0 and apart.grad[:40].abs().max() > 0  # only the tokens looked up
    assert torch.allclose(weight.grad, untied.lm_head.weight.grad, atol=1e-7)
    assert torch.allclose(weight.grad + apart.grad, plain["transformer.wte.weight"], atol=1e-7)
    for name, p in model.named_parameters():
        if name != "transformer.wte.weight":
            assert torch.equal(p.grad, plain[name]), name


def test_the_lookups_gradient_takes_the_tpu_form_wherever_a_tpu_compiler_reads_the_step():
    # On a TPU, or traced on CPU devices for one (scripts/tpu_compile.py's TraceRuntime): the (C, V) columns that
    # let its all-reduce leave the accumulation loop. On XLA:CPU's own devices (the tests, the local demo): rows.
    from types import SimpleNamespace

    from shared.runtime.xla_runtime import XlaRuntime
    from shared.tpu import TPU_GENERATIONS

    columns = XlaRuntime.lookup_grad_columns.fget
    v5e = TPU_GENERATIONS["v5e"]
    assert columns(SimpleNamespace(_hardware="TPU", tpu_generation=v5e))
    assert columns(SimpleNamespace(_hardware="CPU", tpu_generation=v5e))
    assert not columns(SimpleNamespace(_hardware="CPU", tpu_generation=None))
    assert columns(SimpleNamespace(_hardware="CUDA", tpu_generation=None))  # not measured there: as on a TPU


def _random_tokens(n=3, t=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, GPT2_VOCAB_SIZE, (n, t), generator=g)


def test_export_to_hf_gives_same_logits(tmp_path):
    torch.manual_seed(0)
    ours = GPT(SMALL).eval()
    export_hf(ours, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    idx = _random_tokens()
    with torch.no_grad():
        ours_logits, _ = ours(idx)
        hf_logits = hf(idx).logits
    assert hf_logits.shape == ours_logits.shape
    assert (hf_logits - ours_logits).abs().max().item() <= 1e-4


def test_import_from_hf_gives_same_logits(tmp_path):
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=GPT2_VOCAB_SIZE,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():  # HF inits biases and LayerNorms trivially; randomise them so the test sees them
        for p in hf.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).eval()
    assert ours.config.vocab_size == PADDED_VOCAB_SIZE
    idx = _random_tokens()
    with torch.no_grad():
        diff = (ours(idx)[0] - hf(idx).logits).abs().max().item()
    assert diff <= 1e-4
