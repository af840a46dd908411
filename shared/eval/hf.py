"""Hugging Face folders both ways: export our model so `GPT2LMHeadModel.from_pretrained`,
`AutoTokenizer.from_pretrained` and `pipeline("text-generation")` load it, and load an HF GPT-2 folder
(config.json + model.safetensors or pytorch_model.bin) as our model. The conversion itself is here too: our tensors
under `GPT2LMHeadModel`'s names and back (`to_hf_state_dict`, `from_hf_state_dict`) and a `GPT2Config` for ours
(`hf_config_dict`).

The tokenizer files (vocab.json, merges.txt) are derived from GPT-2's tiktoken ranks (see shared.tokenize.tokenizer),
so an export needs no download: GPT-2's token ids are its BPE ranks, and each merge is recovered by running
BPE over a token's bytes with only the lower-ranked merges allowed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.errors import UserError
from shared.model.model import GPT
from shared.model_shape import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, ModelConfig
from shared.train.checkpoint import checkpoint_at

# HF's GPT-2 uses Conv1D (weights stored as in x out); ours are nn.Linear (out x in): these four transpose.
_HF_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """Our parameters under `GPT2LMHeadModel`'s names, vocabulary trimmed to 50257, on the CPU in fp32."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to wte; HF ties it back on load
        t = tensor.detach().to("cpu", torch.float32)
        if name.endswith(_HF_TRANSPOSED):
            t = t.t()
        if name == "transformer.wte.weight":
            t = t[:GPT2_VOCAB_SIZE]
        out[name] = t.contiguous()
    return out


def hf_config_dict(cfg: ModelConfig) -> dict:
    """A `GPT2Config`-compatible dict for our model."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": GPT2_VOCAB_SIZE,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "use_cache": True,
        "tie_word_embeddings": True,
        "bos_token_id": 50256,
        "eos_token_id": 50256,
        "torch_dtype": "float32",
    }


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], hf_config: dict, vocab_size: int | None = None) -> GPT:
    """Build our GPT from a `GPT2LMHeadModel` state dict and config dict (vocabulary padded again)."""
    cfg = ModelConfig(
        n_layer=hf_config["n_layer"],
        n_head=hf_config["n_head"],
        n_embd=hf_config["n_embd"],
        block_size=hf_config["n_positions"],
        vocab_size=vocab_size or PADDED_VOCAB_SIZE,
    )
    model = GPT(cfg)
    ours = model.state_dict()
    with torch.no_grad():
        for name, target in ours.items():
            if name == "lm_head.weight":
                continue
            src = hf_state.get(name)
            if src is None:  # a GPT2Model (no head) names its tensors without "transformer."
                src = hf_state.get(name.removeprefix("transformer."))
            if src is None:
                raise KeyError(f"the state dict lacks {name}")
            src = src.to(torch.float32)
            if name.endswith(_HF_TRANSPOSED):
                src = src.t()
            if name == "transformer.wte.weight":
                target.zero_()
                target[: src.shape[0]].copy_(src)
            else:
                target.copy_(src)
    return model


def export_hf(model: GPT, out_dir: str | os.PathLike, tokenizer: bool = False,
              ranks_path: str | os.PathLike | None = None) -> Path:
    """Write config.json and model.safetensors (vocabulary trimmed to 50257, fp32); with `tokenizer`, also
    the tokenizer and generation files (see `write_tokenizer_files`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config_dict(model.config), indent=2))
    save_file(to_hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer:
        write_tokenizer_files(out, model.config.block_size, ranks_path)
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of vocab.json and merges.txt)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _split_token(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two tokens whose merge made `token`: BPE over its bytes with only lower-ranked merges."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, best_rank = None, limit
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best, best_rank = i, rank
        if best is None:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise UserError(f"GPT-2 ranks: token {token!r} is not the merge of two lower-ranked tokens")
    return parts[0], parts[1]


def gpt2_vocab_and_merges(ranks_path: str | os.PathLike | None = None) -> tuple[dict[str, int], list[str]]:
    """GPT-2's vocab.json mapping and merges.txt lines (without the header), from tiktoken's ranks."""
    from shared.tokenize.tokenizer import EOT_TOKEN, gpt2_encoding

    enc = gpt2_encoding(ranks_path)
    ranks = {b: enc.encode_single_token(b) for b in enc.token_byte_values()}
    byte_char = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    vocab["<|endoftext|>"] = EOT_TOKEN
    merges = []
    for token, _ in sorted(((t, r) for t, r in ranks.items() if len(t) > 1), key=lambda item: item[1]):
        left, right = _split_token(ranks, token)
        merges.append(f"{text(left)} {text(right)}")
    return vocab, merges


def write_tokenizer_files(out_dir: str | os.PathLike, model_max_length: int = 1024,
                          ranks_path: str | os.PathLike | None = None) -> list[Path]:
    """vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json and generation_config.json."""
    from shared.tokenize.tokenizer import EOT_TOKEN

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab, merges = gpt2_vocab_and_merges(ranks_path)
    eot = "<|endoftext|>"
    files = {
        "vocab.json": json.dumps(vocab, ensure_ascii=False),
        "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n",
        "tokenizer_config.json": json.dumps({
            "tokenizer_class": "GPT2Tokenizer", "model_max_length": model_max_length, "add_prefix_space": False,
            "bos_token": eot, "eos_token": eot, "unk_token": eot, "errors": "replace",
            "clean_up_tokenization_spaces": False,
            "added_tokens_decoder": {str(EOT_TOKEN): {"content": eot, "lstrip": False, "normalized": True,
                                                      "rstrip": False, "single_word": False, "special": True}},
        }, indent=2),
        "special_tokens_map.json": json.dumps({"bos_token": eot, "eos_token": eot, "unk_token": eot}, indent=2),
        "generation_config.json": json.dumps({"bos_token_id": EOT_TOKEN, "eos_token_id": EOT_TOKEN,
                                              "pad_token_id": EOT_TOKEN, "do_sample": True, "top_k": 50,
                                              "max_length": model_max_length}, indent=2),
    }
    written = []
    for name, content in files.items():
        (out / name).write_text(content, encoding="utf-8")
        written.append(out / name)
    return written


def load_hf(folder: str | os.PathLike) -> GPT:
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{folder}: no readable config.json ({err})") from None
    weights = next((folder / n for n in ("model.safetensors", "pytorch_model.bin") if (folder / n).exists()), None)
    if weights is None:
        raise UserError(f"{folder}: neither model.safetensors nor pytorch_model.bin")
    try:
        if weights.suffix == ".safetensors":
            state = load_file(str(weights))
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - safetensors and torch raise their own types for a damaged file
        raise UserError(f"{weights}: unreadable ({str(err).splitlines()[0] if str(err) else type(err).__name__})") \
            from None
    try:
        return from_hf_state_dict(state, config)
    except KeyError as err:
        raise UserError(f"{weights}: not a GPT-2 model: {err.args[0]}") from None
    except (RuntimeError, ValueError, TypeError) as err:  # a tensor of another shape than config.json says
        raise UserError(f"{weights}: does not match {folder / 'config.json'}: {str(err).splitlines()[0]}") from None


def model_from_checkpoint(path: str | os.PathLike) -> GPT:
    """Our model (CPU, fp32) from a checkpoint directory, or the newest checkpoint under a run/checkpoints dir."""
    path = Path(path)
    ckpt = checkpoint_at(path)
    if ckpt is None:
        raise UserError(f"{path}: no checkpoint here or under {path / 'checkpoints'}")
    return GPT.from_checkpoint(ckpt)
