"""Text generation from our GPT with a KV cache: linear in the generated length, and one graph under XLA.

`decode_step` reuses the model's own modules (embeddings, LayerNorms, c_attn, c_proj, MLP) and keeps keys and
values in a preallocated cache of the model's full context, written at the position held in a device tensor:
every token, prompt or generated, is the same computation on the same shapes, so XLA compiles it once and the
training path (`GPT.forward`) is untouched. Sampling (temperature, top-k) happens on the host from a seeded
generator: a sample is reproducible from its seed and never touches the device's or torch's global RNG, so a
sample inside training cannot change the training run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.errors import UserError
from shared.model_shape import GPT2_VOCAB_SIZE


@dataclass
class KVCache:
    k: torch.Tensor  # (n_layer, B, H, block_size, D)
    v: torch.Tensor
    pos: torch.Tensor  # () long: the position the next token is written at

    @classmethod
    def empty(cls, model, batch: int, device, dtype=torch.float32) -> KVCache:
        cfg = model.config
        shape = (cfg.n_layer, batch, cfg.n_head, cfg.block_size, cfg.n_embd // cfg.n_head)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros((), dtype=torch.long, device=device))


def decode_step(model, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, vocab) for the next token after `tokens` (B, 1) at position `cache.pos`; updates the cache."""
    cfg = model.config
    B, C, H = tokens.shape[0], cfg.n_embd, cfg.n_head
    D = C // H
    tr = model.transformer
    pos = cache.pos.view(1)
    x = tr.wte(tokens) + tr.wpe(pos)  # (B, 1, C)
    visible = (torch.arange(cfg.block_size, device=tokens.device) <= cache.pos).view(1, -1)  # (1, block_size)
    for i, block in enumerate(tr.h):
        attn = block.attn
        q, k, v = attn.c_attn(block.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, 1, H, D).transpose(1, 2) for t in (q, k, v))  # (B, H, 1, D)
        cache.k[i].index_copy_(2, pos, k.to(cache.k.dtype))
        cache.v[i].index_copy_(2, pos, v.to(cache.v.dtype))
        y = F.scaled_dot_product_attention(q, cache.k[i].to(q.dtype), cache.v[i].to(q.dtype), attn_mask=visible)
        x = x + attn.c_proj(y.transpose(1, 2).reshape(B, 1, C))
        x = x + block.mlp(block.ln_2(x))
    cache.pos += 1
    logits = model.lm_head(tr.ln_f(x))[:, -1, : min(cfg.vocab_size, GPT2_VOCAB_SIZE)]
    return logits.float()


@dataclass
class Sample:
    prompt: str
    text: str  # the generated continuation only
    tokens: list[int]  # the generated token ids
    truncated_prompt: bool = False


def fit_prompt(prompt_tokens: list[int], block_size: int, max_new_tokens: int, label: str = "prompt",
               warn=print) -> tuple[list[int], int]:
    """The prompt (left-truncated if it does not fit the context) and how many tokens can follow it."""
    if not prompt_tokens:
        raise UserError(f"{label} is empty")
    if len(prompt_tokens) >= block_size:
        keep = max(1, block_size // 2)
        warn(f"warning: {label} has {len(prompt_tokens)} tokens, longer than the model's {block_size}-token "
             f"context; using its last {keep} tokens")
        prompt_tokens = prompt_tokens[-keep:]
    room = block_size - len(prompt_tokens)
    if max_new_tokens > room:
        warn(f"warning: {label}: {max_new_tokens} new tokens do not fit the {block_size}-token context after "
             f"{len(prompt_tokens)} prompt tokens; generating {room}")
    return prompt_tokens, min(max_new_tokens, room)


@torch.no_grad()
def generate_tokens(model, runtime, prompt_tokens: list[int], max_new_tokens: int, num_samples: int = 1,
                    temperature: float = 1.0, top_k: int = 50, seed: int = 0, bf16: bool = False,
                    stop_token: int | None = None, warn=print, label: str = "prompt") -> list[list[int]]:
    """`num_samples` continuations of one prompt (token ids); temperature 0 is greedy decoding."""
    if temperature < 0:
        raise UserError(f"temperature must be >= 0, got {temperature}")
    if top_k < 0:
        raise UserError(f"top_k must be >= 0 (0: the whole vocabulary), got {top_k}")
    cfg = model.config
    prompt_tokens, max_new = fit_prompt(list(prompt_tokens), cfg.block_size, max_new_tokens, label, warn)
    vocab = min(cfg.vocab_size, GPT2_VOCAB_SIZE)
    k = min(top_k or vocab, vocab)
    device = runtime.device
    cache = KVCache.empty(model, num_samples, device)
    runtime.sync()  # the cache as device data: every step below is then the same graph
    gen = torch.Generator().manual_seed(seed)
    out: list[list[int]] = [[] for _ in range(num_samples)]
    done = [False] * num_samples
    feed = torch.full((num_samples, 1), prompt_tokens[0], dtype=torch.long)
    steps = len(prompt_tokens) - 1 + max_new
    for i in range(steps):
        with runtime.autocast(bf16):
            logits = decode_step(model, feed.to(device), cache)
        values, indices = (runtime.replicate(t) for t in torch.topk(logits, k, dim=-1))  # sorted: 0 = argmax
        runtime.sync()
        values, indices = values.cpu(), indices.cpu()
        if i + 1 < len(prompt_tokens):  # still reading the prompt
            feed = torch.full((num_samples, 1), prompt_tokens[i + 1], dtype=torch.long)
            continue
        if temperature == 0:
            choice = torch.zeros((num_samples, 1), dtype=torch.long)
        else:
            probs = torch.softmax(values / temperature, dim=-1)
            choice = torch.multinomial(probs, 1, generator=gen)
        feed = indices.gather(1, choice)
        for row in range(num_samples):
            if not done[row]:
                token = int(feed[row, 0])
                out[row].append(token)
                done[row] = stop_token is not None and token == stop_token
        if all(done):
            break
    return out


def sample_text(model, runtime, prompts: list[str], max_new_tokens: int = 64, num_samples: int = 1,
                temperature: float = 1.0, top_k: int = 50, seed: int = 42, bf16: bool = False, encoding=None,
                warn=print) -> list[Sample]:
    """Continuations of each prompt as text; sample j of prompt i uses seed `seed + i`."""
    from shared.tokenize.tokenizer import EOT_TOKEN, gpt2_encoding

    enc = encoding or gpt2_encoding()
    samples = []
    for i, prompt in enumerate(prompts):
        tokens = enc.encode(prompt, allowed_special={"<|endoftext|>"})
        truncated = len(tokens) >= model.config.block_size
        rows = generate_tokens(model, runtime, tokens, max_new_tokens, num_samples, temperature, top_k, seed + i,
                               bf16, stop_token=EOT_TOKEN, warn=warn, label=f"prompt {i + 1}")
        for row in rows:
            text_tokens = row[:-1] if row and row[-1] == EOT_TOKEN else row
            samples.append(Sample(prompt, enc.decode(text_tokens), row, truncated))
    return samples
