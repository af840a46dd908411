"""HellaSwag: the project's scoring against an independent computation with transformers' GPT2LMHeadModel,
on torch and on torch_xla's 8 CPU devices (fixed shapes: one graph), and bad lines in the jsonl."""

import json

import numpy as np
import pytest
import torch

from shared.eval.hf import export_hf
from shared.model.model import GPT
from shared.model_shape import ModelConfig
from shared.runtime.device import make_runtime
from shared.runtime.runtime import Runtime
from shared.train import hellaswag as hs

transformers = pytest.importorskip("transformers")

SMALL = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64)


def random_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(SMALL).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorms, so the comparison sees them
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="module")
def examples(gpt2_ranks) -> list[hs.Example]:
    found = hs.demo_examples(10, seed=3, max_chars=300_000)
    # One context longer than the model's 64 tokens: it is cut on the left, the ending kept whole.
    long_ctx = " ".join(["The interpreter reads the source file line by line and"] * 8)
    found.append(hs.Example(long_ctx, ["stops.", "compiles each statement.", "prints it.", "waits."], 1, "long"))
    return found


@pytest.fixture(scope="module")
def jsonl(examples, tmp_path_factory):
    return hs.write_jsonl(tmp_path_factory.mktemp("hellaswag") / "hellaswag_val.jsonl", examples)


def reference_scores(model: GPT, examples: list[hs.Example], tmp_path) -> tuple[np.ndarray, np.ndarray]:
    """Summed and per-token log-likelihoods of every ending with transformers, row by row, in float64."""
    from shared.tokenize.tokenizer import gpt2_encoding

    export_hf(model, tmp_path / "hf")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").double().eval()
    enc = gpt2_encoding()
    sums, means = [], []
    for ex in examples:
        ctx = enc.encode_ordinary(ex.ctx)
        for ending in ex.endings:
            end = enc.encode_ordinary(" " + ending)
            row = (ctx + end)[-(SMALL.block_size + 1):]
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([row[:-1]])).logits[0], dim=-1)
            start = len(row) - len(end)
            total = sum(logp[t - 1, row[t]].item() for t in range(start, len(row)))
            sums.append(total)
            means.append(total / len(end))
    return np.array(sums).reshape(-1, 4), np.array(means).reshape(-1, 4)


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_scoring_matches_transformers(backend, examples, jsonl, tmp_path):
    model = random_model()
    ref_sum, ref_mean = reference_scores(model, examples, tmp_path)
    runtime = make_runtime(backend) if backend == "xla" else Runtime("cpu")
    warnings = []
    result = hs.evaluate(runtime.prepare_model(model, False), runtime, jsonl, batch_rows=12, bf16=False,
                         warn=warnings.append)
    assert warnings == ["warning: HellaSwag: 4 rows longer than the 64-token context were cut to fit (the context's "
                        "start, or an ending's end)"]
    assert result.examples == len(examples)
    assert np.abs(result.sum_logprob - ref_sum).max() <= 1e-4
    assert np.abs(result.mean_logprob - ref_mean).max() <= 1e-4
    labels = np.array([ex.label for ex in examples])
    assert np.array_equal(result.pred, ref_sum.argmax(1)) and np.array_equal(result.pred_norm, ref_mean.argmax(1))
    assert result.acc == pytest.approx(float((ref_sum.argmax(1) == labels).mean()))
    assert result.acc_norm == pytest.approx(float((ref_mean.argmax(1) == labels).mean()))


def test_xla_scoring_is_one_graph(examples):
    runtime = make_runtime("xla")
    model = runtime.prepare_model(random_model(1), False)
    data = hs.encode(examples, SMALL.block_size)
    assert data.tokens.shape[1] - 1 == data.length <= SMALL.block_size and data.length % 32 == 0
    hs.score(model, runtime, data, batch_rows=16, bf16=True)
    compiles = runtime.compile_count()
    # Another run, and fewer examples (a ragged last batch), compile nothing new: the batches keep one shape.
    hs.score(model, runtime, data, batch_rows=16, bf16=True)
    fewer = hs.encode(examples[:3] + examples[-1:], SMALL.block_size)
    assert fewer.length == data.length
    hs.score(model, runtime, fewer, batch_rows=16, bf16=True)
    assert runtime.compile_count() == compiles


def test_original_format_round_trips(examples, jsonl):
    first = json.loads(jsonl.read_text().splitlines()[0])
    for key in ("ind", "activity_label", "ctx_a", "ctx_b", "ctx", "split", "split_type", "label", "endings",
                "source_id"):
        assert key in first
    back = hs.read_jsonl(jsonl)
    assert [(e.ctx, e.endings, e.label) for e in back] == [(e.ctx, e.endings, e.label) for e in examples]
    assert hs.read_jsonl(jsonl, limit=3)[-1].line == 3
    # Hugging Face hub rows carry the label as a string.
    hub_row = {**first, "label": str(first["label"])}
    assert hs._parse(hub_row, 1).label == first["label"]


def test_malformed_lines_are_named_and_the_rest_evaluated(examples, jsonl, tmp_path):
    lines = jsonl.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    broken = [lines[0], lines[1][:-5], lines[2], json.dumps({**json.loads(lines[3]), "endings": ["a", "b"]}),
              "", json.dumps({**json.loads(lines[4]), "label": 7}), *lines[5:]]
    bad.write_text("\n".join(broken) + "\n")
    warnings = []
    found = hs.read_jsonl(bad, warn=warnings.append)
    assert len(found) == len(examples) - 3
    assert warnings == [
        f"warning: {bad}:2: malformed HellaSwag line skipped: invalid JSON (Unterminated string starting at)",
        f"warning: {bad}:4: malformed HellaSwag line skipped: 'endings' is not a list of 4 non-empty strings",
        f"warning: {bad}:6: malformed HellaSwag line skipped: 'label' 7 is not in 0..3",
    ]
    result = hs.evaluate(random_model(), Runtime("cpu"), bad, bf16=False, warn=warnings.append)
    assert result.examples == len(examples) - 3


def test_odd_lines_are_skipped_by_number_and_odd_characters_kept(examples, jsonl, tmp_path):
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()[:6]]
    # U+2028 and U+0085 are legal unescaped inside a JSON string: they must not end the line.
    rows[0]["ctx"] += " \u2028 next\u0085line"
    nested = "[" * 100_000 + "]" * 100_000
    lines = [json.dumps(rows[0], ensure_ascii=False),
             json.dumps({**rows[1], "label": "2.9"}),  # not an integer: not silently read as 2
             json.dumps(rows[2]).replace(f'"label": {rows[2]["label"]}', '"label": 1e400'),  # int() would overflow
             json.dumps({**rows[3], "label": True}),
             nested,  # json.loads recurses too deep
             json.dumps({**rows[4], "label": str(rows[4]["label"])}),  # the hub's string label is fine
             json.dumps(rows[5])]
    path = tmp_path / "odd.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")  # a BOM and Windows line ends
    warnings = []
    found = hs.read_jsonl(path, warn=warnings.append)
    assert [e.line for e in found] == [1, 6, 7]
    assert found[0].ctx == rows[0]["ctx"] and found[1].label == rows[4]["label"]
    assert [w.split(": malformed")[0] for w in warnings] == [f"warning: {path}:{n}" for n in (2, 3, 4, 5)]
    assert "'label' '2.9' is not an integer" in warnings[0] and "'label' 'True' is not an integer" in warnings[2]


def test_fallback_context_is_ctx_a_and_ctx_b_as_written():
    row = {"ctx_a": "A man is sitting on a roof.", "ctx_b": "he", "endings": ["a", "b", "c", "d"], "label": 0}
    assert hs._parse(row, 1).ctx == "A man is sitting on a roof. he"


def test_an_over_long_ending_is_counted_as_cut(gpt2_ranks):
    long_ending = " ".join(["word"] * 100)  # more tokens than the 64-token context
    data = hs.encode([hs.Example("Short context.", ["a.", "b.", long_ending, "d."], 2)], SMALL.block_size)
    assert data.truncated == 1 and data.ending_tokens.tolist() == [2, 2, 63, 2]


def test_unreadable_or_empty_files_are_one_line_errors(tmp_path):
    from shared.errors import UserError

    with pytest.raises(UserError, match=r"missing.jsonl: cannot read"):
        hs.read_jsonl(tmp_path / "missing.jsonl")
    (tmp_path / "junk.jsonl").write_text("not json\n")
    with pytest.raises(UserError, match=r"junk.jsonl: no valid examples"):
        hs.read_jsonl(tmp_path / "junk.jsonl", warn=lambda _: None)


def test_the_in_training_subset_is_a_seeded_random_sample_in_file_order_the_same_every_time():
    from shared.train.hellaswag import SAMPLE_SEED, demo_examples, sample_examples

    examples = demo_examples(60, max_chars=200_000)
    picked = sample_examples(examples, 20)
    assert len(picked) == 20 and len({id(e) for e in picked}) == 20
    lines = [examples.index(e) for e in picked]
    assert lines == sorted(lines) and lines != list(range(20))  # in file order, and not the first 20
    assert [examples.index(e) for e in sample_examples(examples, 20)] == lines  # the same every call
    assert [examples.index(e) for e in sample_examples(examples, 20, seed=SAMPLE_SEED + 1)] != lines
    assert sample_examples(examples, 0) == examples and sample_examples(examples, 60) == examples
    assert sample_examples(examples, 500) == examples
