"""Token shards (llm.c format) and the loader: exact bytes, bad files named, deterministic resumable order."""

import numpy as np
import pytest

from shared.data import HEADER_BYTES, SHARD_MAGIC, LoaderState, TokenLoader, find_shards, read_shard, write_shard
from shared.errors import UserError


def test_shard_round_trip_and_exact_layout(tmp_path):
    tokens = np.array([50256, 15496, 995, 0, 65535], dtype=np.uint16)
    path = tmp_path / "x_train_000001.bin"
    write_shard(path, tokens)
    raw = path.read_bytes()
    header = np.frombuffer(raw[:HEADER_BYTES], dtype=np.int32)
    assert header[:3].tolist() == [SHARD_MAGIC, 1, 5] and not header[3:].any()
    assert np.frombuffer(raw[HEADER_BYTES:], dtype=np.uint16).tolist() == tokens.tolist()
    assert read_shard(path).tolist() == tokens.tolist()
    assert not list(tmp_path.glob(".*tmp"))  # the temporary file was renamed away


def test_bad_shards_are_named_errors(tmp_path):
    good = tmp_path / "a_train_000001.bin"
    write_shard(good, np.arange(100, dtype=np.uint16))
    wrong_magic = tmp_path / "b_train_000002.bin"
    data = bytearray(good.read_bytes())
    data[:4] = np.int32(12345).tobytes()
    wrong_magic.write_bytes(bytes(data))
    truncated = tmp_path / "c_train_000003.bin"
    truncated.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(UserError, match=r"b_train_000002.bin: not a token shard \(magic 12345"):
        read_shard(wrong_magic)
    with pytest.raises(UserError, match=r"c_train_000003.bin: truncated"):
        read_shard(truncated)
    with pytest.raises(UserError, match="b_train_000002.bin: not a token shard"):  # checked up front
        TokenLoader(find_shards(tmp_path, "train"), batch=2, seq_len=8)


def test_find_shards_natural_order_across_parts(tmp_path):
    for part in (0, 2, 10):
        d = tmp_path / f"part-{part}"
        d.mkdir()
        write_shard(d / f"fw_train_{part:06d}.bin", np.zeros(10, dtype=np.uint16))
    write_shard(tmp_path / "part-0" / "fw_val_000000.bin", np.zeros(10, dtype=np.uint16))
    names = [p.parent.name for p in find_shards(str(tmp_path), "train")]
    assert names == ["part-0", "part-2", "part-10"]
    # The file name decides, not the folder (Kaggle mounts the same parts under other names across sessions).
    (tmp_path / "part-10").rename(tmp_path / "a-mount")
    assert [p.name for p in find_shards(str(tmp_path), "train")] == [f"fw_train_{i:06d}.bin" for i in (0, 2, 10)]
    assert len(find_shards(f"{tmp_path}/part-0,{tmp_path}/part-2", "train")) == 2
    assert [p.name for p in find_shards(tmp_path, "val")] == ["fw_val_000000.bin"]
    with pytest.raises(UserError, match="missing-dir is not a directory"):
        find_shards(tmp_path / "missing-dir", "train")


def _loader_fixture(tmp_path, seed=3):
    for i in range(3):
        write_shard(tmp_path / f"t_train_{i:06d}.bin", (np.arange(1000) + 1000 * i).astype(np.uint16))
    return find_shards(tmp_path, "train")


def test_loader_batches_are_consecutive_tokens_with_shifted_targets(tmp_path):
    shards = _loader_fixture(tmp_path)
    loader = TokenLoader(shards, batch=4, seq_len=8, shuffle=False)
    batch = loader.next_batch()
    assert batch.shape == (4, 9) and batch.dtype == np.int32
    assert batch[0].tolist() == list(range(0, 9))
    assert batch[1].tolist() == list(range(8, 17))  # rows overlap by the one target token
    assert loader.state.offset == 32


def test_loader_order_depends_on_seed_and_resumes_exactly(tmp_path):
    shards = _loader_fixture(tmp_path)
    a = TokenLoader(shards, batch=4, seq_len=50, seed=1)
    stream = [a.next_batch() for _ in range(40)]  # crosses shards and an epoch boundary
    first_values = {int(b[0, 0]) // 1000 for b in stream}
    assert first_values == {0, 1, 2}
    # Same seed, state saved after 13 batches and restored into a new loader: the same next batches.
    b = TokenLoader(shards, batch=4, seq_len=50, seed=1)
    for _ in range(13):
        b.next_batch()
    saved = LoaderState.from_dict(b.state.to_dict())
    c = TokenLoader(shards, batch=4, seq_len=50, seed=1, state=saved)
    for i in range(13, 40):
        assert np.array_equal(c.next_batch(), stream[i])
    assert c.state.epoch >= 1
    orders = {tuple(TokenLoader(shards, 4, 50, seed=s)._order(0)) for s in range(6)}
    assert len(orders) > 1  # the seed changes the shard order


def test_loader_rejects_shards_smaller_than_a_batch(tmp_path):
    write_shard(tmp_path / "t_train_000001.bin", np.arange(10, dtype=np.uint16))
    with pytest.raises(UserError, match="no shard holds one batch"):
        TokenLoader(find_shards(tmp_path, "train"), batch=4, seq_len=8)


def test_resume_over_other_shards_is_refused_or_starts_a_new_epoch(tmp_path):
    shards = _loader_fixture(tmp_path)
    a = TokenLoader(shards, batch=4, seq_len=50, seed=1)
    for _ in range(7):
        a.next_batch()
    saved = a.state.to_dict()
    assert saved["shards"] == [[f"t_train_{i:06d}.bin", 1000] for i in range(3)]
    # The same shards in another folder: the same next batch.
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    for p in shards:
        p.rename(moved / p.name)
    b = TokenLoader(find_shards(moved, "train"), batch=4, seq_len=50, seed=1, state=LoaderState.from_dict(saved))
    assert np.array_equal(b.next_batch(), a.next_batch()) and not b.changed
    # A token part added: the saved position indexes another list, so it is refused in one line...
    write_shard(moved / "t_train_000003.bin", (np.arange(1000) + 3000).astype(np.uint16))
    more = find_shards(moved, "train")
    with pytest.raises(UserError, match=r"over other training shards \(3 shards of 3,000 tokens then, 4 of 4,000 "
                                        r"now\).*--on-data-change new-epoch"):
        TokenLoader(more, batch=4, seq_len=50, seed=1, state=LoaderState.from_dict(saved))
    # ...or, when asked, the next epoch starts over all four shards, in that epoch's order.
    c = TokenLoader(more, batch=4, seq_len=50, seed=1, state=LoaderState.from_dict(saved), on_change="new-epoch")
    assert c.changed == "3 shards of 3,000 tokens then, 4 of 4,000 now"
    assert (c.state.epoch, c.state.shard_index, c.state.offset) == (saved["epoch"] + 1, 0, 0)
    first_shard = c._order(saved["epoch"] + 1)[0]
    assert int(c.next_batch()[0, 0]) == 1000 * first_shard
    assert c.state.to_dict()["shards"][-1] == ["t_train_000003.bin", 1000]
    # A checkpoint from before the shard list was saved resumes as it did.
    old = {k: v for k, v in saved.items() if k != "shards"}
    d = TokenLoader(more, batch=4, seq_len=50, seed=1, state=LoaderState.from_dict(old))
    assert (d.state.epoch, d.state.shard_index, d.state.offset) == (saved["epoch"], saved["shard_index"],
                                                                     saved["offset"])


def test_batches_per_pass_counts_whole_batches_per_shard(tmp_path):
    write_shard(tmp_path / "v_val_000000.bin", np.arange(500, dtype=np.uint16))
    write_shard(tmp_path / "v_val_000001.bin", np.arange(65, dtype=np.uint16))
    loader = TokenLoader(find_shards(tmp_path, "val"), batch=4, seq_len=16, shuffle=False)
    assert loader.batches_per_pass() == 499 // 64 + 64 // 64
    seen = [loader.next_batch()[0, 0] for _ in range(loader.batches_per_pass() + 1)]
    assert seen[-1] == seen[0]  # one more batch wraps round to the first
