"""Fixtures and helpers for the tokenize tests: test_tokenize.py (the part logic, in process) and
test_tokenize_kernel.py (the kernel as a script: killed, restarted, given bad input).

tokenize/conftest.py imports the fixtures, so each is made once per session for both files: the corpus with its expected
tokens, and one reference run over it. The test modules import the helpers.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shared.config import TokenizeConfig
from shared.data import read_shard
from shared.errors import run_cli
from shared.tokenize.manifest import MANIFEST
from shared.tokenize.part import tokenize_part
from shared.tokenize.tokenizer import EOT_TOKEN, gpt2_encoding

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "kernels" / "tokenize.py"


@pytest.fixture(scope="session")
def ranks(gpt2_ranks) -> str:
    return str(gpt2_ranks)


@pytest.fixture(scope="session")
def enc(ranks):
    return gpt2_encoding(ranks)


def sample_documents() -> list:
    """Real English text: the paragraphs of Python's help topics, plus a few awkward documents."""
    from pydoc_data.topics import topics

    docs = [p for _, text in sorted(topics.items()) for p in text.split("\n\n") if p.strip()]
    docs[5:5] = ["Hello world", "", "literal <|endoftext|> inside a document", "naïve café – 日本語 🙂"]
    return docs


@pytest.fixture(scope="session")
def corpus(tmp_path_factory, enc):
    """The documents as 3 parquet files (small row groups) and as 2 jsonl files, with the expected tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = sample_documents()
    root = tmp_path_factory.mktemp("corpus")
    cuts = [0, 900, 1900, len(docs)]
    for i in range(3):
        chunk = docs[cuts[i]:cuts[i + 1]]
        table = pa.table({"id": list(range(cuts[i], cuts[i + 1])), "text": chunk})
        pq.write_table(table, root / f"train-{i:05d}.parquet", row_group_size=97)
    (root / "jsonl").mkdir()
    for i, chunk in enumerate([docs[:1000], docs[1000:]]):
        with open(root / "jsonl" / f"part{i}.jsonl", "w") as f:
            for d in chunk:
                f.write(json.dumps({"text": d, "meta": {"n": len(d)}}) + "\n")
    per_doc = [[EOT_TOKEN] + enc.encode_ordinary(d) for d in docs]
    expected = np.array([t for toks in per_doc for t in toks], dtype=np.uint16)
    return {
        "parquet": str(root / "train-*.parquet"),
        "jsonl": str(root / "jsonl" / "*.jsonl"),
        "docs": docs,
        "lengths": [len(t) for t in per_doc],
        "expected": expected,
    }


def tokenize_config(corpus, ranks, out_dir, **kw) -> TokenizeConfig:
    base = dict(data_files=corpus["parquet"], out_dir=str(out_dir), shard_size=20_000, processes=1, batch_docs=64,
                ranks_path=ranks, progress=False)
    base.update(kw)
    return TokenizeConfig(**base)


def run_tokenize(corpus, ranks, out_dir, **kw) -> dict:
    return tokenize_part(tokenize_config(corpus, ranks, out_dir, **kw), log=lambda msg: None)


def read_tokens(*dirs) -> np.ndarray:
    """The tokens of the parts in `dirs`, in manifest order, concatenated."""
    out = []
    for d in dirs:
        manifest = json.loads((Path(d) / MANIFEST).read_text())
        out += [np.asarray(read_shard(Path(d) / s["name"])) for s in manifest["shards"]]
    return np.concatenate(out) if out else np.zeros(0, np.uint16)


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def kernel_args(corpus, ranks, out_dir, *extra) -> list:
    return ["--data-files", corpus["parquet"], "--out-dir", str(out_dir), "--shard-size", "20000",
            "--processes", "1", "--batch-docs", "64", "--ranks-path", ranks, "--no-progress", *extra]


def run_kernel(*args, env=None, timeout=120, python: str = sys.executable) -> subprocess.CompletedProcess:
    """The tokenize kernel in a process of its own (`python`: an image's stand-in, where given)."""
    return subprocess.run([python, str(KERNEL), *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture(scope="session")
def reference(tmp_path_factory, corpus, ranks):
    """One uninterrupted run of the whole corpus (parquet input, 20k-token shards)."""
    out = tmp_path_factory.mktemp("reference")
    manifest = run_tokenize(corpus, ranks, out)
    return out, manifest


def assert_same_shards(out: Path, ref: Path) -> None:
    got, want = snapshot(out), snapshot(ref)
    assert sorted(got) == sorted(want)
    for name in want:
        if name != MANIFEST:
            assert got[name] == want[name], name
    m_got, m_want = json.loads(got[MANIFEST]), json.loads(want[MANIFEST])
    assert m_got["complete"] and m_got["shards"] == [dict(s, checkpoint=g["checkpoint"]) for s, g in
                                                     zip(m_want["shards"], m_got["shards"], strict=True)]
    assert (m_got["num_tokens"], m_got["num_docs"], m_got["end"]["doc"]) == (
        m_want["num_tokens"], m_want["num_docs"], m_want["end"]["doc"])


def load_kernel():
    spec = importlib.util.spec_from_file_location("tokenize_kernel", KERNEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_error(argv) -> tuple[int, str]:
    kernel = load_kernel()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        run_cli(lambda: kernel.main([str(a) for a in argv]))
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return exc.value.code, lines[0]
