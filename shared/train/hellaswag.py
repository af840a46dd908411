"""HellaSwag, scored the standard (completion) way: each of an example's four endings is appended to its
context, and the ending's tokens are scored by their summed log-likelihood (acc) and by that sum divided by
their number (acc_norm), as in build-nanogpt, whose GPT-2 124M reference is acc_norm 0.2945 on the 10,042
validation examples.

Data: the original jsonl (rowanz/hellaswag `hellaswag_val.jsonl`: one JSON object per line with ctx, endings,
label, ...), fetched from GitHub or the Hugging Face hub when there is internet, or any local file in that
format (`write_jsonl` writes one; `demo_examples` makes a small offline set from the demo corpus).
A malformed line is a one-line warning with its line number; the other examples are evaluated.

Scoring is batched over all devices with fixed shapes: every row is padded to one length (right padding
cannot change a causal model's earlier positions), and every batch to the same number of rows, so XLA
compiles one graph however many examples there are. Only one float per row comes back to the host.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from shared.errors import UserError

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HUB_DATASET = "Rowan/hellaswag"
MAX_WARNINGS = 10  # malformed lines reported one by one; past this, one summary line


@dataclass
class Example:
    ctx: str
    endings: list[str]
    label: int
    ind: int | str | None = None
    activity_label: str = ""
    line: int = 0  # 1-based line in its jsonl file (0: not from a file)


def _parse(record, line: int) -> Example:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    ctx = record.get("ctx")
    if not isinstance(ctx, str) and isinstance(record.get("ctx_a"), str):
        ctx = (record["ctx_a"] + " " + str(record.get("ctx_b", ""))).strip()  # how rowanz's `ctx` is made
    if not isinstance(ctx, str) or not ctx.strip():
        raise ValueError("no 'ctx'")
    endings = record.get("endings")
    if not isinstance(endings, list) or len(endings) != 4 or not all(isinstance(e, str) and e for e in endings):
        raise ValueError("'endings' is not a list of 4 non-empty strings")
    raw = record.get("label")  # an int in rowanz's files, a string of digits on the Hugging Face hub
    digits = isinstance(raw, str) and raw.strip().isascii() and raw.strip().isdigit()
    if isinstance(raw, bool) or not (isinstance(raw, int) or digits):
        raise ValueError(f"'label' {str(raw)[:40]!r} is not an integer")
    label = int(raw)
    if not 0 <= label < 4:
        raise ValueError(f"'label' {label} is not in 0..3")
    return Example(ctx, endings, label, record.get("ind"), str(record.get("activity_label", "")), line)


def read_jsonl(path: str | os.PathLike, limit: int = 0, warn=print) -> list[Example]:
    """Examples from a HellaSwag jsonl file; malformed lines are skipped with a warning naming the line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig", errors="replace")
    except OSError as err:
        raise UserError(f"HellaSwag file {path}: cannot read ({err.strerror or err})") from None
    examples, bad = [], 0
    # Lines end at "\n" only: str.splitlines would also cut at U+2028 and the like, which JSON strings may hold.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            examples.append(_parse(json.loads(line), number))
        except (ValueError, RecursionError) as err:  # json.JSONDecodeError is a ValueError
            bad += 1
            if bad <= MAX_WARNINGS:
                reason = f"invalid JSON ({err.msg})" if isinstance(err, json.JSONDecodeError) else str(err)
                warn(f"warning: {path}:{number}: malformed HellaSwag line skipped: {reason}")
        if limit and len(examples) >= limit:
            break
    if bad > MAX_WARNINGS:
        warn(f"warning: {path}: {bad} malformed lines skipped in all")
    if not examples:
        raise UserError(f"HellaSwag file {path}: no valid examples")
    return examples


SAMPLE_SEED = 1234  # the in-training subset: the same examples in every eval, session and run


def sample_examples(examples: list[Example], n: int, seed: int = SAMPLE_SEED) -> list[Example]:
    """A seeded random `n` of `examples` (all where n is 0 or not below their count), in file order: HellaSwag's
    lines are grouped by source and activity, so the first n would be no sample of the whole."""
    if not n or n >= len(examples):
        return examples
    picked = np.sort(np.random.default_rng(seed).choice(len(examples), size=n, replace=False))
    return [examples[i] for i in picked]


def write_jsonl(path: str | os.PathLike, examples: list[Example]) -> Path:
    """Write examples in the original HellaSwag jsonl format (the fields of rowanz/hellaswag's files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i, ex in enumerate(examples):
            ctx_a, _, ctx_b = ex.ctx.rpartition(". ")
            ctx_a, ctx_b = (ctx_a + ".", ctx_b) if ctx_a else (ex.ctx, "")
            f.write(json.dumps({
                "ind": ex.ind if ex.ind is not None else i, "activity_label": ex.activity_label or "demo",
                "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": ex.ctx, "split": "val", "split_type": "indomain",
                "label": ex.label, "endings": list(ex.endings), "source_id": f"demo~{i}",
            }) + "\n")
    return path


def download(dest: str | os.PathLike, log=print) -> Path:
    """The validation jsonl, from GitHub (the original file) or else the Hugging Face hub; needs internet."""
    dest = Path(dest)
    if dest.is_file() and dest.stat().st_size > 0:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    errors = []
    try:
        import urllib.request

        with urllib.request.urlopen(HELLASWAG_URL, timeout=60) as response, open(tmp, "wb") as f:
            f.write(response.read())
        os.replace(tmp, dest)
        log(f"HellaSwag: downloaded {HELLASWAG_URL}")
        return dest
    except Exception as err:  # no internet, HTTP error: try the hub
        errors.append(f"GitHub: {type(err).__name__}")
    try:
        from datasets import load_dataset

        rows = load_dataset(HUB_DATASET, split="validation")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(dict(row)) + "\n")
        os.replace(tmp, dest)
        log(f"HellaSwag: downloaded {HUB_DATASET} from the Hugging Face hub")
        return dest
    except Exception as err:
        errors.append(f"hub: {type(err).__name__}")
    raise UserError(f"HellaSwag: cannot download the validation set ({'; '.join(errors)}); "
                    "give a local jsonl file instead")


def demo_examples(n: int = 200, seed: int = 0, max_chars: int = 2_000_000) -> list[Example]:
    """A small offline HellaSwag-format set from the demo corpus (Python's documentation): the context is a
    sentence's first half, the right ending its second half, the wrong endings second halves of other
    sentences. A model trained on the demo corpus should beat chance on it."""
    from shared.tokenize.demo_corpus import demo_documents

    sentences = []
    for doc in demo_documents(max_chars):
        for raw in doc.replace("\n", " ").split(". "):
            words = raw.split()
            if 10 <= len(words) <= 40 and all(w.isprintable() for w in words):
                sentences.append(words)
    rng = random.Random(seed)
    rng.shuffle(sentences)
    if len(sentences) < n + 3:
        raise UserError(f"demo corpus has only {len(sentences)} usable sentences for {n} examples")
    examples = []
    for i in range(n):
        words = sentences[i]
        cut = len(words) // 2
        others = [rng.choice(sentences[n:]) for _ in range(3)]
        endings = [" ".join(o[len(o) // 2:]) + "." for o in others]
        label = rng.randrange(4)
        endings.insert(label, " ".join(words[cut:]) + ".")
        examples.append(Example(" ".join(words[:cut]), endings, label, i, "python docs"))
    return examples


# --- tokenisation and scoring ---------------------------------------------------------------------------------

@dataclass
class Encoded:
    """Four rows per example: context + ending tokens, right-padded to one length, with the ending masked."""

    tokens: np.ndarray  # (4n, L + 1) int32: a row's inputs are [:-1], its targets [1:]
    mask: np.ndarray  # (4n, L) int32: 1 where the target is an ending token
    labels: np.ndarray  # (n,)
    truncated: int = 0  # rows cut to fit the model's context (context on the left, an over-long ending on the right)
    examples: list[Example] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def ending_tokens(self) -> np.ndarray:
        return self.mask.sum(axis=1)


def truncation_warning(data: Encoded, block_size: int) -> str:
    return (f"warning: HellaSwag: {data.truncated} rows longer than the {block_size}-token context were cut to fit "
            "(the context's start, or an ending's end)")


def encode(examples: list[Example], block_size: int, encoding=None, pad_to: int = 32) -> Encoded:
    """Tokenise examples into fixed-length rows: the length is the longest row rounded up to `pad_to`
    (capped at `block_size`); a row longer than that keeps its ending and the end of its context."""
    from shared.tokenize.tokenizer import gpt2_encoding

    enc = encoding or gpt2_encoding()
    rows, truncated = [], 0
    for ex in examples:
        ctx = enc.encode_ordinary(ex.ctx)
        for ending in ex.endings:
            full_end = enc.encode_ordinary(" " + ending)
            end = full_end[: block_size - 1]
            row = ctx + end
            if len(row) - 1 > block_size or len(end) < len(full_end):
                row = row[max(0, len(row) - 1 - block_size):]
                truncated += 1
            rows.append((row, len(end)))
    longest = max(len(r) - 1 for r, _ in rows)
    length = min(block_size, -(-longest // pad_to) * pad_to)
    tokens = np.zeros((len(rows), length + 1), dtype=np.int32)
    mask = np.zeros((len(rows), length), dtype=np.int32)
    for i, (row, n_end) in enumerate(rows):
        tokens[i, : len(row)] = row
        mask[i, len(row) - 1 - n_end: len(row) - 1] = 1  # targets t-1 predict tokens t
    return Encoded(tokens, mask, np.array([ex.label for ex in examples]), truncated, list(examples))


@dataclass
class HellaSwagResult:
    examples: int
    acc: float
    acc_norm: float
    sum_logprob: np.ndarray  # (n, 4): summed log-likelihood of each ending
    mean_logprob: np.ndarray  # (n, 4): per ending token
    pred: np.ndarray  # (n,) argmax of sum_logprob
    pred_norm: np.ndarray  # (n,) argmax of mean_logprob

    @property
    def acc_norm_se(self) -> float:
        """acc_norm's standard error over the examples scored (binomial: sqrt(p(1-p)/n))."""
        return math.sqrt(self.acc_norm * (1 - self.acc_norm) / self.examples) if self.examples else 0.0

    def to_record(self) -> dict:
        return {"hellaswag_acc": self.acc, "hellaswag_acc_norm": self.acc_norm,
                "hellaswag_acc_norm_se": round(self.acc_norm_se, 5), "hellaswag_examples": self.examples}


def _row_logprobs(model, rows: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of the masked targets of each row. rows: (B, 2, L + 1) = tokens, mask."""
    tokens, mask = rows[:, 0], rows[:, 1, 1:]
    logits, _ = model(tokens[:, :-1])
    logp = torch.log_softmax(logits.float(), dim=-1)
    picked = logp.gather(-1, tokens[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    return (picked * mask.float()).sum(dim=1)


@torch.no_grad()
def score(model, runtime, data: Encoded, batch_rows: int = 64, bf16: bool = True) -> HellaSwagResult:
    """acc and acc_norm of `model` on encoded examples, `batch_rows` rows (rounded up to a multiple of the
    devices) per forward pass; the last batch is padded to the same shape with empty rows."""
    devices = runtime.num_devices
    batch_rows = max(devices, -(-batch_rows // devices) * devices)
    n_rows, width = data.tokens.shape
    packed = np.zeros((n_rows, 2, width), dtype=np.int32)
    packed[:, 0] = data.tokens
    packed[:, 1, 1:] = data.mask
    sums = np.zeros(n_rows, dtype=np.float64)
    runtime.sync()
    for start in range(0, n_rows, batch_rows):
        chunk = packed[start:start + batch_rows]
        if chunk.shape[0] < batch_rows:
            chunk = np.concatenate([chunk, np.zeros((batch_rows - chunk.shape[0], 2, width), np.int32)])
        with runtime.autocast(bf16):
            # XLA: the batch sharded over the mesh. Elsewhere (DDP included) each process scores every row.
            rows = (runtime.batch_to_device(chunk) if getattr(runtime, "name", "") == "xla"
                    else torch.from_numpy(chunk).to(runtime.device))
            out = runtime.replicate(_row_logprobs(model, rows))
        runtime.sync()
        take = min(batch_rows, n_rows - start)
        sums[start:start + take] = out.cpu().numpy()[:take]
    sum_lp = sums.reshape(-1, 4)
    mean_lp = (sums / np.maximum(data.ending_tokens, 1)).reshape(-1, 4)
    pred, pred_norm = sum_lp.argmax(axis=1), mean_lp.argmax(axis=1)
    return HellaSwagResult(len(data.labels), float((pred == data.labels).mean()),
                           float((pred_norm == data.labels).mean()), sum_lp, mean_lp, pred, pred_norm)


def evaluate(model, runtime, source: str | os.PathLike, limit: int = 0, batch_rows: int = 64, bf16: bool = True,
             encoding=None, warn=print) -> HellaSwagResult:
    """Read (the first `limit` examples of) a jsonl file, encode for the model's context, and score."""
    examples = read_jsonl(source, limit, warn)
    data = encode(examples, model.config.block_size, encoding)
    if data.truncated:
        warn(truncation_warning(data, model.config.block_size))
    return score(model, runtime, data, batch_rows, bf16)
