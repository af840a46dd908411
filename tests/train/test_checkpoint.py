"""Checkpoints: whole or absent, verified on load, corrupt ones skipped with a notice (and set aside by the
trainer, out of rotation), shape mismatches refused in one line."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import shared.train.checkpoint
from shared.errors import UserError
from shared.fsutil import sha256_file
from shared.model.model import GPT
from shared.model_shape import ModelConfig
from shared.train.checkpoint import (
    check_same_shape,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


def _tensors(step):
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(4, 3, generator=g)}, {"w.exp_avg": torch.randn(4, 3, generator=g)}


def _save(root, step, keep=3, metrics=None):
    model, opt = _tensors(step)
    state = {"loader": {"epoch": 0, "shard_index": 0, "offset": step}, "config": {"model": {"n_layer": 2}}}
    return save_checkpoint(root, step, model, opt, state, metrics_file=metrics, keep=keep)


def test_round_trip_with_manifest_and_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 3.5}\n')
    path = _save(tmp_path / "ck", 7, metrics=metrics)
    assert path.name == "step_000007"
    manifest = json.loads((path / "checkpoint.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "optimizer.safetensors", "state.json", "metrics.jsonl"}
    loaded = load_checkpoint(path)
    model, opt = _tensors(7)
    assert loaded.step == 7 and loaded.state["loader"]["offset"] == 7
    assert torch.equal(loaded.model["w"], model["w"]) and torch.equal(loaded.optimizer["w.exp_avg"], opt["w.exp_avg"])
    assert "torch" in loaded.state["versions"]
    assert (path / "metrics.jsonl").read_text() == metrics.read_text()


def test_keeps_last_n(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    blob = bytearray((newest / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(blob))
    assert "fails its sha256 check" in verify_checkpoint(newest)
    notices = []
    loaded = latest_checkpoint(tmp_path, log=notices.append)
    assert loaded.step == 1
    assert len(notices) == 1 and "step_000002" in notices[0] and "\n" not in notices[0]
    assert newest.exists()  # nothing is deleted


def test_partial_checkpoint_is_invisible_and_all_corrupt_is_an_error(tmp_path):
    path = _save(tmp_path, 5)
    (tmp_path / ".tmp-step_000006-123").mkdir()  # a save killed half-way
    assert latest_checkpoint(tmp_path).step == 5
    (path / "checkpoint.json").unlink()
    with pytest.raises(UserError, match="no checkpoint verifies"):
        latest_checkpoint(tmp_path, log=lambda _: None)
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_kill_during_save_leaves_previous_checkpoint_whole(tmp_path):
    _save(tmp_path, 1)
    # A process that dies (os._exit) right after writing its tensors, before the manifest and rename.
    code = textwrap.dedent(f"""
        import os, torch, safetensors.torch as st
        real = st.save_file
        calls = []
        def dying_save(*a, **k):
            real(*a, **k); calls.append(1)
            if len(calls) == 2: os._exit(9)
        st.save_file = dying_save
        import shared.train.checkpoint as c
        c.save_file = dying_save
        c.save_checkpoint({str(tmp_path)!r}, 2, {{"w": torch.ones(2)}}, {{"w.exp_avg": torch.ones(2)}}, {{}})
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd())
    assert proc.returncode == 9
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000001"]
    assert latest_checkpoint(tmp_path).step == 1


def test_shape_mismatch_is_one_line_error(tmp_path):
    loaded = load_checkpoint(_save(tmp_path, 3))
    check_same_shape(loaded, {"n_layer": 2})
    with pytest.raises(UserError, match=r"different model shape: n_layer=2 \(run asks 4\)"):
        check_same_shape(loaded, {"n_layer": 4})


def _corrupt(path):
    blob = bytearray((path / "model.safetensors").read_bytes())
    blob[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(blob))


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_trainer_sets_a_corrupt_checkpoint_aside_and_it_never_counts_as_kept(tmp_path):
    _save(tmp_path, 100)
    bad = _save(tmp_path, 200)
    _corrupt(bad)
    notices = []
    loaded = latest_checkpoint(tmp_path, log=notices.append, set_aside=True)
    assert loaded.step == 100
    aside = tmp_path / "corrupt-step_000200"
    assert aside.is_dir() and not bad.exists()
    assert notices == [f"warning: skipping corrupt checkpoint: {bad}: model.safetensors fails its sha256 check; "
                       f"set aside as {aside}"]
    before = _tree(aside)
    # The session resumed from 100 saves 150 keeping 2: the good 100 stays, the corrupt 200 is no candidate.
    _save(tmp_path, 150, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000100", "step_000150"]
    assert _tree(aside) == before
    # The same step corrupted again is set aside beside the first, which stays as it was.
    _corrupt(_save(tmp_path, 200))
    notices.clear()
    assert latest_checkpoint(tmp_path, log=notices.append, set_aside=True).step == 150
    assert notices[0].endswith(f"set aside as {tmp_path / 'corrupt-step_000200-2'}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "corrupt-step_000200", "corrupt-step_000200-2", "step_000100", "step_000150"]
    assert _tree(aside) == before


def test_corrupt_checkpoint_in_a_read_only_root_is_reported_and_skipped(tmp_path, monkeypatch):
    _save(tmp_path, 100)
    bad = _save(tmp_path, 200)
    _corrupt(bad)

    def read_only(self, target):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "rename", read_only)
    notices = []
    assert latest_checkpoint(tmp_path, log=notices.append, set_aside=True).step == 100
    assert notices == [f"warning: skipping corrupt checkpoint: {bad}: model.safetensors fails its sha256 check "
                       "(could not set it aside: Permission denied)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000100", "step_000200"]


def test_rotation_never_deletes_a_good_checkpoint_to_keep_a_corrupt_one(tmp_path, monkeypatch):
    for step in (100, 120, 200):
        _save(tmp_path, step)
    _corrupt(tmp_path / "step_000120")
    _corrupt(tmp_path / "step_000200")  # newer than the next save: left where it could not be set aside
    monkeypatch.setattr(shared.train.checkpoint, "_known_good", {})  # a new session: nothing verified yet
    _save(tmp_path, 150, keep=2)
    # Kept: 150 and the newest older one that verifies (100); the corrupt 120 goes, the later 200 is left alone.
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000100", "step_000150", "step_000200"]
    _save(tmp_path, 160, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000150", "step_000160", "step_000200"]


_SHAPE = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=256)


def _model_checkpoint(root, cfg=_SHAPE, saved_config=None):
    """A checkpoint of GPT(cfg) whose state.json says `saved_config` (manifest re-written so it verifies)."""
    torch.manual_seed(0)
    path = save_checkpoint(root, 1, GPT(cfg).checkpoint_tensors(), {"none": torch.zeros(1)},
                           {"config": {"model": cfg.to_dict()}})
    if saved_config is not None:
        (path / "state.json").write_text(json.dumps({"step": 1, "config": {"model": saved_config.to_dict()}}))
        manifest = json.loads((path / "checkpoint.json").read_text())
        manifest["files"]["state.json"] = {"sha256": sha256_file(path / "state.json"),
                                           "bytes": (path / "state.json").stat().st_size}
        (path / "checkpoint.json").write_text(json.dumps(manifest))
    return path


def test_tensors_of_another_shape_are_the_one_line_shape_error(tmp_path):
    path = _model_checkpoint(tmp_path)
    loaded = load_checkpoint(path)
    with pytest.raises(UserError) as err:
        GPT(ModelConfig(**{**_SHAPE.to_dict(), "block_size": 32})).load_checkpoint_tensors(loaded.model, path)
    assert str(err.value) == f"{path}: checkpoint is a different model shape: block_size=64 (run asks 32)"
    # The same words as the trainer's check of state.json.
    with pytest.raises(UserError) as trainer_err:
        check_same_shape(loaded, {**_SHAPE.to_dict(), "block_size": 32})
    assert str(trainer_err.value) == str(err.value)
    # Several fields at once, in ModelConfig's order.
    other = ModelConfig(n_layer=3, n_head=2, n_embd=48, block_size=64, vocab_size=128)
    with pytest.raises(UserError) as err:
        GPT(other).load_checkpoint_tensors(loaded.model, "ckpt")
    assert str(err.value) == ("ckpt: checkpoint is a different model shape: n_layer=2 (run asks 3), "
                              "n_embd=32 (run asks 48), vocab_size=256 (run asks 128)")
    # A difference no config field explains names the tensor and both shapes.
    odd = {**loaded.model, "transformer.h.1.mlp.c_fc.weight": torch.zeros(64, 32)}
    with pytest.raises(UserError) as err:
        GPT(_SHAPE).load_checkpoint_tensors(odd, "ckpt")
    assert str(err.value) == ("ckpt: checkpoint is a different model shape: "
                              "transformer.h.1.mlp.c_fc.weight=[64, 32] (run asks [128, 32])")
    GPT(_SHAPE).load_checkpoint_tensors(loaded.model, path)  # the right shape loads


def test_eval_and_export_refuse_a_state_json_that_disagrees_with_the_tensors(tmp_path):
    from shared.eval.hf import model_from_checkpoint

    path = _model_checkpoint(tmp_path / "run" / "checkpoints", saved_config=ModelConfig(
        **{**_SHAPE.to_dict(), "block_size": 32}))
    expected = f"{path}: checkpoint is a different model shape: block_size=64 (run asks 32)"
    with pytest.raises(UserError) as err:
        GPT.from_checkpoint(load_checkpoint(path))  # what the eval kernel does
    assert str(err.value) == expected
    for named in (path, tmp_path / "run"):  # export: a checkpoint, or the newest under a run
        with pytest.raises(UserError) as err:
            model_from_checkpoint(named)
        assert str(err.value) == expected
