"""A small real-English corpus that builds offline: Python's own documentation as shipped with CPython
(the language reference in `pydoc_data.topics`, and the docstrings of the standard library's modules).
For demos and tests; real runs use FineWeb-Edu through the tokenize kernel."""

from __future__ import annotations

import ast
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from shared.data import write_shard
from shared.tokenize.tokenizer import EOT_TOKEN


def demo_documents(max_chars: int = 8_000_000) -> Iterator[str]:
    """Documents in a fixed order: the language reference topics, then stdlib docstrings (module by module)."""
    import pydoc_data.topics

    total = 0
    for _, text in sorted(pydoc_data.topics.topics.items()):
        total += len(text)
        yield text
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        parts = [doc for n in nodes if (doc := ast.get_docstring(n)) and len(doc) > 200]
        if parts:
            doc = "\n\n".join(parts)
            total += len(doc)
            yield doc
        if total >= max_chars:
            return


def eot_tokens(enc, docs: list[str], num_threads: int = 4) -> np.ndarray:
    """The documents' GPT-2 tokens, each document preceded by EOT, as one uint16 array."""
    return np.concatenate([np.array([EOT_TOKEN, *toks], dtype=np.uint16)
                           for toks in enc.encode_ordinary_batch(docs, num_threads=num_threads)])


def write_split_shards(out: Path, prefix: str, split: str, tokens: np.ndarray, shard_tokens: int,
                       first_index: int = 0) -> list[str]:
    """`tokens` as `<prefix>_<split>_NNNNNN.bin` shards of shard_tokens each, numbered from first_index."""
    names = []
    for i, start in enumerate(range(0, len(tokens), shard_tokens), start=first_index):
        names.append(f"{prefix}_{split}_{i:06d}.bin")
        write_shard(out / names[-1], tokens[start:start + shard_tokens])
    return names


def build_demo_corpus(out_dir: str | Path, shard_tokens: int = 200_000, val_tokens: int = 100_000,
                      ranks_path: str | None = None, max_chars: int = 8_000_000) -> dict:
    """Tokenize the demo documents (EOT before each) into `demo_val_000000.bin` and `demo_train_*.bin`."""
    from shared.tokenize.tokenizer import gpt2_encoding

    docs = list(demo_documents(max_chars))
    tokens = eot_tokens(gpt2_encoding(ranks_path), docs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_shard(out / "demo_val_000000.bin", tokens[:val_tokens])
    names = write_split_shards(out, "demo", "train", tokens[val_tokens:], shard_tokens, first_index=1)
    return {"documents": len(docs), "tokens": int(tokens.size), "val_tokens": int(min(val_tokens, tokens.size)),
            "train_shards": names}
