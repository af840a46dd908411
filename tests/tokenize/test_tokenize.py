"""The tokenize kernel's logic, run in process: exact tokens, shards, parts, restarts, disk budget and sources
(issue 4). The kernel as a script, killed and given bad input: test_tokenize_kernel.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenize_fixtures import assert_same_shards, kernel_args, kernel_error, read_tokens, run_tokenize, sample_documents

from shared.data import find_shards
from shared.fsutil import sha256_file
from shared.tokenize.manifest import MANIFEST
from shared.tokenize.tokenizer import EOT_TOKEN


def test_offline_tokenizer_hello_world(enc):
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.decode([15496, 995]) == "Hello world"


def test_tokens_equal_raw_tiktoken_and_shard_layout(corpus, reference):
    out, manifest = reference
    tokens = read_tokens(out)
    np.testing.assert_array_equal(tokens, corpus["expected"])
    # "Hello world" is document 5: EOT, Hello, world
    start = sum(corpus["lengths"][:5])
    assert tokens[start:start + 3].tolist() == [EOT_TOKEN, 15496, 995]
    assert manifest["complete"] and manifest["stop_reason"] == "end_of_stream"
    assert manifest["num_tokens"] == len(corpus["expected"]) == sum(corpus["lengths"])
    assert manifest["num_docs"] == len(corpus["docs"])
    assert manifest["end"]["doc"] == len(corpus["docs"]) and manifest["end"]["offset"] == 0
    shards = manifest["shards"]
    n_full = len(corpus["expected"]) // 20_000
    assert [s["tokens"] for s in shards] == [20_000] * n_full + [len(corpus["expected"]) - 20_000 * n_full]
    assert shards[0]["name"] == "fineweb_val_000000.bin" and shards[0]["split"] == "val"
    assert [s["name"] for s in shards[1:]] == [f"fineweb_train_{i:06d}.bin" for i in range(1, len(shards))]
    assert find_shards(out, "val") == [out / "fineweb_val_000000.bin"]
    assert [p.name for p in find_shards(out, "train")] == [s["name"] for s in shards[1:]]
    for s in shards:
        assert sha256_file(out / s["name"]) == s["sha256"]
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST] + [s["name"] for s in shards])
    assert manifest["source"]["kind"] == "local" and [f["name"] for f in manifest["source"]["files"]] == [
        "train-00000.parquet", "train-00001.parquet", "train-00002.parquet"]
    assert manifest["tokenizer"]["name"] == "gpt2"


def test_jsonl_input_and_two_processes_give_the_same_tokens(corpus, ranks, tmp_path):
    manifest = run_tokenize(corpus, ranks, tmp_path / "out", data_files=corpus["jsonl"], processes=2, batch_docs=50)
    np.testing.assert_array_equal(read_tokens(tmp_path / "out"), corpus["expected"])
    assert manifest["num_docs"] == len(corpus["docs"])


def test_parts_concatenate_to_one_run(corpus, ranks, tmp_path):
    full = run_tokenize(corpus, ranks, tmp_path / "full", shard_size=7_000)
    p0 = run_tokenize(corpus, ranks, tmp_path / "p0", shard_size=7_000, tokens_per_part=50_000, batch_docs=37)
    p1 = run_tokenize(corpus, ranks, tmp_path / "p1", shard_size=7_000, tokens_per_part=50_000, part=1,
              prev_dir=str(tmp_path / "p0"), batch_docs=53)
    p2 = run_tokenize(corpus, ranks, tmp_path / "p2", shard_size=7_000, tokens_per_part=50_000, part=2,
              prev_dir=str(tmp_path / "p1"))
    # a part ends at the document boundary where it reaches its token count
    ends = np.cumsum(corpus["lengths"])
    assert p0["stop_reason"] == "part_size" and p0["end"]["offset"] == 0
    assert p0["num_tokens"] == int(ends[np.searchsorted(ends, 50_000)])
    assert p1["start"]["doc"] == p0["end"]["doc"] and p1["stop_reason"] == "part_size"
    assert p2["stop_reason"] == "end_of_stream"
    both = read_tokens(tmp_path / "p0", tmp_path / "p1", tmp_path / "p2")
    np.testing.assert_array_equal(both, read_tokens(tmp_path / "full"))
    np.testing.assert_array_equal(both, corpus["expected"])
    assert p0["num_docs"] + p1["num_docs"] + p2["num_docs"] == full["num_docs"]
    # shard numbering continues across parts; only part 0 has the validation shard
    names = [s["name"] for m in (p0, p1, p2) for s in m["shards"]]
    assert names == ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, len(names))]
    assert p1["first_shard_index"] == len(p0["shards"])
    # part 1 of a finished stream: nothing left
    code, err = kernel_error(kernel_args(corpus, ranks, tmp_path / "p3", "--part", "3", "--prev-dir",
                                           tmp_path / "p2"))
    assert code == 2 and "end of the stream" in err


def test_output_budget_stops_cleanly_and_next_part_continues_mid_document(corpus, ranks, tmp_path):
    shard = 9_999  # odd size: shard ends fall inside documents
    gb = (3 * (1024 + 2 * shard) + 8000) / 1e9  # three shards and a manifest fit, four do not
    p0 = run_tokenize(corpus, ranks, tmp_path / "p0", shard_size=shard, max_output_gb=gb)
    assert p0["complete"] and p0["stop_reason"] == "output_budget"
    assert [s["tokens"] for s in p0["shards"]] == [shard] * 3
    assert p0["summary"]["new_tokens"] == 3 * shard  # what reached shards, not what was read
    assert p0["end"]["offset"] > 0  # the part ends inside a document
    assert sum(f.stat().st_size for f in (tmp_path / "p0").iterdir()) <= gb * 1e9
    p1 = run_tokenize(corpus, ranks, tmp_path / "p1", shard_size=shard, part=1, prev_dir=str(tmp_path / "p0"))
    assert p1["stop_reason"] == "end_of_stream"
    np.testing.assert_array_equal(read_tokens(tmp_path / "p0", tmp_path / "p1"), corpus["expected"])
    assert p0["num_docs"] + p1["num_docs"] == len(corpus["docs"])
    # running part 0 again in its directory: verified, nothing redone
    again = run_tokenize(corpus, ranks, tmp_path / "p0", shard_size=shard, max_output_gb=gb)
    assert again["summary"]["new_tokens"] == 0 and again["shards"] == p0["shards"]


def test_encode_docs_matches_encode_ordinary_on_every_path(enc):
    import shared.tokenize.workers as tc

    texts = ["Hello world", "", "a <|endoftext|> b", "lone \ud800 surrogate", "naïve café 🙂 " * 50]
    want = [t for text in texts for t in [EOT_TOKEN] + enc.encode_ordinary(text)]
    tc._ENC = enc
    try:
        for fn in (tc.encode_docs, tc._encode_docs_lists):
            tokens, lengths = fn(texts)
            assert tokens.dtype == np.uint16 and tokens.tolist() == want
            assert lengths.tolist() == [len(enc.encode_ordinary(t)) + 1 for t in texts]
    finally:
        tc._ENC = None


def test_hub_source_pins_its_revision_across_restarts_and_parts(monkeypatch, corpus, ranks, tmp_path):
    """The --dataset route (here served from the local parquet files): load_dataset arguments, pinned revision."""
    import glob

    import datasets

    import shared.tokenize.part as tc

    real = datasets.load_dataset
    calls = []

    def fake_load_dataset(path, name=None, *, split=None, streaming=False, revision=None, **kw):
        if path != "org/corpus":
            return real(path, name, split=split, streaming=streaming, revision=revision, **kw)
        calls.append((path, name, split, streaming, revision))
        return real("parquet", data_files=sorted(glob.glob(corpus["parquet"])), split="train", streaming=True)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(tc, "resolve_hub_revision", lambda dataset, revision, *_: revision or "abc123")
    hub = dict(data_files="", dataset="org/corpus", config="sub", tokens_per_part=60_000)
    p0 = run_tokenize(corpus, ranks, tmp_path / "p0", **hub)
    assert p0["source"] == {"kind": "hub", "dataset": "org/corpus", "config": "sub", "split": "train",
                            "revision": "abc123", "text_column": "text"}
    assert calls == [("org/corpus", "sub", "train", True, "abc123")]
    again = run_tokenize(corpus, ranks, tmp_path / "p0", **hub)  # resumed without --revision: same pinned snapshot
    assert again["summary"]["new_tokens"] == 0
    p1 = run_tokenize(corpus, ranks, tmp_path / "p1", part=1, prev_dir=str(tmp_path / "p0"), **hub)
    assert p1["source"]["revision"] == "abc123" and calls[-1][-1] == "abc123"
    n = p0["num_tokens"] + p1["num_tokens"]
    np.testing.assert_array_equal(read_tokens(tmp_path / "p0", tmp_path / "p1"), corpus["expected"][:n])
    with pytest.raises(tc.UserError, match="another source"):
        run_tokenize(corpus, ranks, tmp_path / "p1b", part=1, prev_dir=str(tmp_path / "p0"), revision="v2", **hub)


def _forget_last_shards(out: Path, keep: int) -> None:
    """What a kill leaves after `keep` shards were recorded: the manifest incomplete, later shards gone."""
    manifest = json.loads((out / MANIFEST).read_text())
    for s in manifest["shards"][keep:]:
        (out / s["name"]).unlink()
    manifest["shards"] = manifest["shards"][:keep]
    last = manifest["shards"][-1]
    manifest["end"] = {**last["end"], "checkpoint": last["checkpoint"]}
    manifest["complete"], manifest["stop_reason"] = False, None
    (out / MANIFEST).write_text(json.dumps(manifest))


def test_restart_at_the_end_of_a_part(corpus, ranks, tmp_path):
    ends = np.cumsum(corpus["lengths"])
    i = next(i for i in range(100, len(ends)) if corpus["lengths"][i] > 20)
    target = int(ends[i]) - 7  # inside document i: the part ends with it, 7 tokens past its target
    ref = run_tokenize(corpus, ranks, tmp_path / "ref", shard_size=target, tokens_per_part=target)
    assert [s["tokens"] for s in ref["shards"]] == [target, 7] and ref["end"] == {**ref["end"], "doc": i + 1}
    # killed after the first shard (which ends inside document i, at the target) was recorded
    out = tmp_path / "out"
    run_tokenize(corpus, ranks, out, shard_size=target, tokens_per_part=target)
    _forget_last_shards(out, keep=1)
    again = run_tokenize(corpus, ranks, out, shard_size=target, tokens_per_part=target)
    assert again["stop_reason"] == "part_size" and again["summary"]["new_tokens"] == 7
    assert_same_shards(out, tmp_path / "ref")
    # killed after the last shard was recorded, before the manifest said complete
    _forget_last_shards(out, keep=2)
    again = run_tokenize(corpus, ranks, out, shard_size=target, tokens_per_part=target)
    assert again["stop_reason"] == "part_size" and again["summary"]["new_tokens"] == 0
    assert_same_shards(out, tmp_path / "ref")


def _stream_position(lengths: list[int], tokens: int) -> tuple[int, int]:
    """(document, offset) of the stream after `tokens` tokens, as a manifest records shard ends."""
    ends = np.cumsum(lengths)
    doc = int(np.searchsorted(ends, tokens, side="right"))
    return doc, tokens - (int(ends[doc - 1]) if doc else 0)


def test_parts_through_documents_longer_than_a_shard(enc, ranks, tmp_path):
    """Parts stopped by a small budget start inside documents several shards long; every shard's recorded end
    is the true stream position, and the parts concatenate to the whole stream."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = sample_documents()[:40]
    docs[3] = " ".join(sample_documents()[:150])  # thousands of tokens: several shards
    docs[7] = docs[3][::-1]
    pq.write_table(pa.table({"text": docs}), tmp_path / "long.parquet")
    lengths = [1 + len(enc.encode_ordinary(d)) for d in docs]
    expected = np.array([t for d in docs for t in [EOT_TOKEN] + enc.encode_ordinary(d)], dtype=np.uint16)
    assert max(lengths) > 3 * 700
    data = {"parquet": str(tmp_path / "long.parquet")}
    gb = (2 * (1024 + 2 * 700) + 6000) / 1e9  # two shards of 700 tokens and the manifest per part
    dirs: list[Path] = []
    for part in range(100):
        dirs.append(tmp_path / f"p{part}")
        m = run_tokenize(data, ranks, dirs[-1], shard_size=700, max_output_gb=gb, part=part,
                 prev_dir=str(dirs[-2]) if part else "")
        assert m["shards"], part
        if m["stop_reason"] == "end_of_stream":
            break
    assert 10 < len(dirs) < 100
    starts = [json.loads((d / MANIFEST).read_text())["start"] for d in dirs]
    assert sum(s["offset"] > 0 for s in starts) > 5  # parts that begin inside a document
    np.testing.assert_array_equal(read_tokens(*dirs), expected)
    written = 0
    for d in dirs:
        for shard in json.loads((d / MANIFEST).read_text())["shards"]:
            written += shard["tokens"]
            assert (shard["end"]["doc"], shard["end"]["offset"]) == _stream_position(lengths, written), shard["name"]


def test_a_part_that_cannot_write_one_shard_is_an_error(corpus, ranks, tmp_path):
    from shared.config import MANIFEST_SLACK
    from shared.errors import UserError

    gb = (1024 + 2 * 20_000 + MANIFEST_SLACK) / 1e9  # one shard passes the flag check, but not next to a manifest
    with pytest.raises(UserError, match=r"--max-output-gb 4.512e-05: no room for part 0's first shard "
                                        r"\(41,024 bytes\) next to its manifest"):
        run_tokenize(corpus, ranks, tmp_path / "p0", max_output_gb=gb)
    assert not (tmp_path / "p0").exists()  # nothing left behind
    p0 = run_tokenize(corpus, ranks, tmp_path / "ok", tokens_per_part=30_000)
    with pytest.raises(UserError, match="no room for part 1's first shard"):  # not a "complete" empty part
        run_tokenize(corpus, ranks, tmp_path / "p1", part=1, prev_dir=str(tmp_path / "ok"), max_output_gb=gb)
    assert not (tmp_path / "p1").exists() and p0["complete"]


def test_every_parquet_file_is_checked_for_the_text_column(corpus, ranks, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["fine", "also fine"]}), tmp_path / "a-good.parquet")
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "b-ints.parquet")
    out = tmp_path / "out"
    code, line = kernel_error(kernel_args({"parquet": str(tmp_path / "*.parquet")}, ranks, out))
    assert code == 2 and line == (f"error: {tmp_path / 'b-ints.parquet'}: column 'text' holds int64, not text; "
                                  "see --text-column")
    (tmp_path / "b-ints.parquet").unlink()
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "c-body.parquet")
    code, line = kernel_error(kernel_args({"parquet": str(tmp_path / "*.parquet")}, ranks, out))
    assert code == 2 and f"{tmp_path / 'c-body.parquet'}: no text column 'text' (columns: body)" in line
    assert not out.exists()


def test_a_pool_that_will_not_terminate_is_killed_after_the_wait():
    import threading

    from shared.tokenize.workers import shut_down

    class Worker:
        killed = False

        def kill(self):
            self.killed = True

    class StuckPool:  # terminate blocks as CPython's did on its task queue's lock
        def __init__(self):
            self._pool, self.released = [Worker(), Worker()], threading.Event()

        def terminate(self):
            self.released.wait()

        def join(self):
            raise AssertionError("join after a terminate that never returned")

    pool, lines = StuckPool(), []
    shut_down(pool, wait_s=0.2, log=lines.append)
    assert all(w.killed for w in pool._pool)
    assert lines == ["notice: the tokenizer pool did not stop within 0.2s; its workers are killed"]
    pool.released.set()

    class GoodPool:
        _pool, calls = [], []

        def terminate(self):
            self.calls.append("terminate")

        def join(self):
            self.calls.append("join")

    good = GoodPool()
    shut_down(good, log=lines.append)
    assert good.calls == ["terminate", "join"] and len(lines) == 1


def test_the_previous_part_is_found_among_inputs_that_hold_another_kind_of_manifest_too(tmp_path):
    """On Kaggle --prev-dir may be the whole input tree; another dataset's manifest.json there is passed over,
    while an unreadable manifest.json is still an error naming it."""
    from shared.errors import UserError
    from shared.tokenize.manifest import MANIFEST_FORMAT, find_prev_manifest

    part0 = {"format": MANIFEST_FORMAT, "part": 0, "complete": True, "stop_reason": "token_budget"}
    (tmp_path / "other-dataset").mkdir()
    (tmp_path / "other-dataset" / MANIFEST).write_text(json.dumps({"format": 1, "step": 40, "files": {}}))
    (tmp_path / "tokens-part-0").mkdir()
    (tmp_path / "tokens-part-0" / MANIFEST).write_text(json.dumps(part0))
    assert find_prev_manifest(str(tmp_path), 1) == part0
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / MANIFEST).write_text("{not json")
    with pytest.raises(UserError, match=r"broken/manifest.json: unreadable manifest"):
        find_prev_manifest(str(tmp_path), 1)
