"""GPT-2 (nanoGPT-sized and readable): learned positions, pre-LN blocks, GELU(tanh), tied embeddings.

The vocabulary is padded to 50304 for faster matmuls; the 🤗 export (shared/eval/hf.py) trims it back to GPT-2's 50257.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.errors import UserError
from shared.model.attention import SDPA_CHOICE, AttentionChoice
from shared.model.loss_head import head_loss
from shared.model_shape import GPT2_VOCAB_SIZE, ModelConfig, different_shape_error


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     attention: AttentionChoice = SDPA_CHOICE) -> torch.Tensor:
    """Causal attention over q, k, v (B, H, T, D): `attention`'s kernel where it runs at T, else SDPA."""
    kernel = attention.kernel_for(q.shape[-2])
    if kernel is not None:
        return kernel(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def token_embedding(weight: torch.Tensor, idx: torch.Tensor, grad_apart: torch.Tensor | None = None,
                    columns: bool = True) -> torch.Tensor:
    """The rows of `weight` (V, C) at `idx`. With `grad_apart` (a leaf of weight's shape), the lookup's gradient
    goes to grad_apart.grad instead of weight.grad (see GPT.embedding_grad_apart), scattered into (C, V) columns
    and transposed where `columns` (the form a TPU's compiler needs, below), else straight into (V, C) rows."""
    if grad_apart is None or not torch.is_grad_enabled():
        return F.embedding(idx, weight)
    return _EmbeddingGradApart.apply(weight, idx, grad_apart, columns)


class _EmbeddingGradApart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, idx, grad_apart, columns):
        ctx.save_for_backward(idx)
        ctx.num_rows, ctx.columns = weight.shape[0], columns
        return F.embedding(idx, weight)

    @staticmethod
    def backward(ctx, grad_rows):
        (idx,) = ctx.saved_tensors
        width = grad_rows.shape[-1]
        idx, grad_rows = idx.reshape(-1), grad_rows.reshape(-1, width)
        if not ctx.columns:  # the same sums, without the (C, V) transpose
            rows = torch.zeros(ctx.num_rows, width, dtype=grad_rows.dtype, device=grad_rows.device)
            return None, None, rows.index_add(0, idx, grad_rows), None
        # The scatter-add runs into a (C, V) zeros, transposed after: XLA folds `accumulator + scatter(zeros, ..)`
        # into `scatter(accumulator, ..)` (its all-reduce then carries the accumulator and cannot leave the
        # loop), but not through a transpose.
        columns = torch.zeros(width, ctx.num_rows, dtype=grad_rows.dtype, device=grad_rows.device)
        return None, None, columns.index_add(1, idx, grad_rows.t()).t(), None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionChoice = SDPA_CHOICE):
        super().__init__()
        self.n_head = cfg.n_head
        self.attention = attention  # the kernel (or SDPA) chosen for this session's shapes
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.c_proj.residual_scaled_init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        layout = self.attention.qkv_layout
        if layout and self.attention.kernel_for(T) is not None:
            return self._forward_heads(x, layout)
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = causal_attention(q, k, v, self.attention)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def _forward_heads(self, x: torch.Tensor, layout: str) -> torch.Tensor:
        """The same attention for a kernel that reads q, k and v laid out as `layout` ("BHTD", or "BHDT": the
        sequence minor, seen as (B, H, T, D)): one einsum makes all three straight in it, and the output is
        projected from its heads by an einsum. On TPU, XLA then lays the matmuls out as the kernel reads them, with
        no copies between (docs/tpu-throughput.md, "The layout around the kernels")."""
        C = x.shape[-1]
        D = C // self.n_head
        # One einsum for the three: each weight's gradient is then one matmul's, summed straight into its
        # accumulator, so XLA can all-reduce it once a step (a slice per q, k, v kept it in the loop).
        weight = self.c_attn.weight.view(3, self.n_head, D, C)
        if layout == "BHDT":
            qkv = torch.einsum("btc,shdc->sbhdt", x, weight)
            qkv = _plus_bias(qkv, self.c_attn.bias.view(3, 1, self.n_head, D, 1)).transpose(-1, -2)
        else:
            qkv = torch.einsum("btc,shdc->sbhtd", x, weight)
            qkv = _plus_bias(qkv, self.c_attn.bias.view(3, 1, self.n_head, 1, D))
        y = causal_attention(*qkv.unbind(0), self.attention)
        return _plus_bias(torch.einsum("bhtd,chd->btc", y, self.c_proj.weight.view(C, self.n_head, D)),
                          self.c_proj.bias)


def _plus_bias(t: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # In the matmul's dtype (bf16 under autocast), as nn.Linear adds it: an fp32 bias would make the sum fp32.
    return t + bias.to(t.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.c_proj.residual_scaled_init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionChoice = SDPA_CHOICE):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg, attention)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionChoice = SDPA_CHOICE):
        """`attention`: the kernel the session chose for its shapes (`select_attention_and_micro_batch`,
        shared/runtime/step.py; shared/model/attention.py); SDPA by default."""
        super().__init__()
        self.config = cfg
        self.attention = attention
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                h=nn.ModuleList(Block(cfg, attention) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        # How the block stack runs, set by the runtime (prepare_model, shared/runtime/runtime.py): a checkpoint
        # function (block, x) -> x that recomputes a block's activations in the backward pass, and/or a runner
        # (blocks, x) -> x for the whole stack (XLA's scan: one block compiled once). None: a plain loop.
        self.block_checkpoint = None
        self.block_stack = None
        self._embedding_grad_apart: torch.Tensor | None = None  # set inside embedding_grad_apart() only
        self._lookup_grad_columns = True
        # Padded vocabulary columns are masked out of the loss (not sliced off) so the head's matmul keeps its
        # 128-aligned width: -inf logits add nothing to the softmax and get zero gradient.
        self.register_buffer("vocab_padding", self.vocab_padding_mask(), persistent=False)

    @contextlib.contextmanager
    def embedding_grad_apart(self, columns: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """While inside, the token lookup's gradient goes to a leaf of its own, yielded with wte's weight, instead
        of into wte.weight.grad beside the tied head's. Under SPMD each of the two is all-reduced; XLA's
        WhileLoopAllReduceCodeMotion moves an all-reduce out of the accumulation loop only when it reaches an
        accumulator of its own through adds, so the loop keeps two sums for wte and adds them after it
        (shared/runtime/accum_loop.py): its gradient is then all-reduced once a step, not every micro-step.
        `columns`: the lookup's gradient scattered into (C, V) and transposed, which that needs on a TPU
        (`token_embedding`); False where no compiler moves an all-reduce out of a loop (XLA:CPU), where the
        transpose only costs."""
        weight = self.transformer.wte.weight
        self._embedding_grad_apart = torch.empty_like(weight).requires_grad_()  # never read: only its .grad
        self._lookup_grad_columns = columns
        try:
            yield weight, self._embedding_grad_apart
        finally:
            self._embedding_grad_apart, self._lookup_grad_columns = None, True

    def vocab_padding_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """True at the vocabulary's padded columns (past GPT-2's 50257 tokens)."""
        return torch.arange(self.config.vocab_size, device=device) >= GPT2_VOCAB_SIZE

    def zero_output_projections(self) -> None:
        """The attention and MLP output projections (c_proj) at zero: each block starts as the identity on the
        residual stream (modded-nanogpt's 2024-10-14 record); gradients still reach them through the residual."""
        with torch.no_grad():
            for block in self.transformer.h:
                for proj in (block.attn.c_proj, block.mlp.c_proj):
                    proj.weight.zero_()
                    proj.bias.zero_()

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 init: N(0, 0.02); projections into the residual stream scaled by 1/sqrt(2 * n_layer).
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_scaled_init", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _apply(self, fn, *args, **kwargs):
        # Moving to an XLA device replaces each Parameter object, which would silently untie lm_head from wte.
        super()._apply(fn, *args, **kwargs)
        self.lm_head.weight = self.transformer.wte.weight
        return self

    @classmethod
    def from_checkpoint(cls, ckpt) -> GPT:
        """The model (CPU, fp32) of a `shared.train.checkpoint.LoadedCheckpoint`, shaped by its saved config."""
        model = cls(ModelConfig.from_dict(ckpt.state["config"]["model"]))
        model.load_checkpoint_tensors(ckpt.model, ckpt.path)
        return model

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters as checkpoints store them: on the host, fp32, the tied lm_head once (as wte)."""
        return {k: v.detach().to("cpu", torch.float32) for k, v in self.state_dict().items()
                if k != "lm_head.weight"}

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], source) -> None:
        """Load `checkpoint_tensors` output; anything but exactly our parameters is a UserError naming `source`.

        Tensors of another model shape are refused by the config fields they imply (as the trainer's
        check_same_shape words it), or where no field explains it by the tensor and both shapes.
        """
        found = {k: list(v.shape) for k, v in tensors.items()}
        expected = {k: list(v.shape) for k, v in self.state_dict().items() if k != "lm_head.weight"}  # tied: wte
        if found != expected:
            implied = {}  # the config fields the tensors imply (n_head leaves no trace in the shapes)
            if len(found.get("transformer.wpe.weight", [])) == 2:
                implied["block_size"], implied["n_embd"] = found["transformer.wpe.weight"]
            if found.get("transformer.wte.weight"):
                implied["vocab_size"] = found["transformer.wte.weight"][0]
            blocks = {k.split(".")[2] for k in found if k.startswith("transformer.h.")}
            if blocks:
                implied["n_layer"] = len(blocks)
            asked = self.config.to_dict()
            differences = {k: (implied[k], v) for k, v in asked.items() if k in implied and implied[k] != v}
            if not differences:
                differences = {k: (found[k], expected[k]) for k in expected if k in found and found[k] != expected[k]}
            if differences:
                raise different_shape_error(source, differences)
            raise UserError(f"{source}: model tensors do not match (missing {sorted(expected.keys() - found.keys())}"
                            f", extra {sorted(found.keys() - expected.keys())})")
        self.load_state_dict(tensors, strict=False)  # lm_head.weight is missing by design: it is wte

    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # the tied lm_head is counted once
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """(logits (B, T, 50257), None), or with targets (None, the mean cross-entropy over all positions)."""
        # The positions are a slice, not a lookup of arange(T): its gradient is the batch's sum, which XLA can
        # all-reduce once after the accumulation loop (a lookup's is a scatter it keeps inside).
        lookup = token_embedding(self.transformer.wte.weight, idx, self._embedding_grad_apart,
                                 self._lookup_grad_columns)
        x = lookup + self.transformer.wpe.weight[: idx.shape[1]]
        if self.block_stack is not None:
            x = self.block_stack(self.transformer.h, x)
        else:
            recompute = self.block_checkpoint is not None and torch.is_grad_enabled()  # nothing to save in evals
            for block in self.transformer.h:
                x = self.block_checkpoint(block, x) if recompute else block(x)
        # The padded vocabulary rows only speed up the matmul: logits and loss cover GPT-2's 50257 tokens,
        # so the model is exactly the exported Hugging Face one.
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x)[..., : min(self.config.vocab_size, GPT2_VOCAB_SIZE)], None
        # With targets only the loss comes back, made a chunk of positions at a time (shared/model/loss_head.py):
        # no [tokens x vocab] logits are kept for the backward pass or as an output of the step.
        return None, head_loss(x, self.lm_head.weight, targets, self.vocab_padding)
