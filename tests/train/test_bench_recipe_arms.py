"""scripts/bench_recipe_arms.py: the arms are the shipped settings with one change each, the attention scale
multiplies every attention output, the weight RMS is read per block matrix, each seed reads data of its own, and
an arm's difference from the shipped settings is judged by a paired interval."""

import json
import math

import numpy as np
import pytest
import torch
from helpers import example_config, train_config
from safetensors.torch import save_file

from scripts.bench_recipe_arms import (
    attention_output_scaled,
    block_matrix_rms,
    final_rms_by_kind,
    layer_kind,
    paired_interval,
    recipe_arms,
    report,
    seed_data_dirs,
    shipped_settings,
    t_quantile_975,
)
from shared.config import TrainConfig
from shared.data import find_shards, read_shard, write_shard
from shared.errors import UserError
from shared.model.model import GPT
from shared.model_shape import ModelConfig


def test_the_shipped_arm_is_the_example_files_optimizer_and_schedule(tmp_path):
    example = example_config("chain-gpt2-124m-muon.json")["train"]
    shipped = shipped_settings()
    assert {k: shipped[k] for k in shipped if k in example} == {k: example[k] for k in shipped if k in example}
    assert shipped["aux_lr"] == 6e-4  # the example's own
    assert shipped["min_lr_ratio"] == TrainConfig().lr_schedule.min_lr_ratio  # left out of the example: the default
    changed = tmp_path / "example.json"
    changed.write_text(json.dumps({"train": {**example, "muon_lr": 0.0009}}))
    assert shipped_settings(changed)["muon_lr"] == 0.0009


def test_each_arm_changes_only_its_own_settings():
    shipped = shipped_settings()
    arms = recipe_arms(shipped, steps=500, n_layer=4)
    assert list(arms) == ["shipped", "aux-lr-at-lr", "warmup", "muon-decay", "attn-scale", "no-clip",
                          "adamw-build-nanogpt"]
    changes = {name: {k: v for k, v in settings.items() if shipped[k] != v} for name, (settings, _) in arms.items()}
    assert changes["shipped"] == {} and changes["attn-scale"] == {}
    # The example sets the position embedding's, biases' and gains' rate: the arm puts them back at `lr` (0: the
    # record's one AdamW rate); `lr`, the tied embedding's, stays as shipped.
    assert changes["aux-lr-at-lr"] == {"aux_lr": 0.0}
    assert changes["warmup"] == {"warmup_steps": 19}  # 715 of 19,073 steps
    assert changes["muon-decay"] == {"muon_weight_decay": 0.5}  # Moonlight's strength per step, whatever the length
    assert recipe_arms(shipped, steps=5000, n_layer=4)["muon-decay"][0]["muon_weight_decay"] == 0.5
    assert changes["no-clip"] == {"grad_clip": 0.0}  # the example clips at 1.0: the arm is the other side
    assert changes["adamw-build-nanogpt"] == {"optimizer": "adamw", "lr": 6e-4, "aux_lr": 0.0, "weight_decay": 0.1,
                                              "schedule": "cosine", "warmup_steps": 19}
    unclipped = recipe_arms({**shipped, "grad_clip": 0.0}, steps=500, n_layer=4)  # as the 2-seed bench ran it
    assert "clip" in unclipped and unclipped["clip"][0]["grad_clip"] == 1.0
    record_rates = recipe_arms({**shipped, "aux_lr": 0.0}, steps=500, n_layer=4)  # as the 4-seed bench ran it
    assert record_rates["aux-lr-6e-4"][0] == {**shipped, "aux_lr": 6e-4}
    assert arms["attn-scale"][1] == pytest.approx(8 ** -0.5) and {a[1] for n, a in arms.items() if n != "attn-scale"} \
        == {1.0}
    for settings, _ in arms.values():  # every arm is a config the trainer accepts
        train_config(**settings, total_steps=500)


def test_the_attention_scale_multiplies_every_attention_output_and_is_undone_after():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)).eval()
    x = torch.randn(1, 8, 32)
    attn = model.transformer.h[0].attn
    plain = attn(x)
    with attention_output_scaled(0.25):
        assert torch.allclose(attn(x), plain * 0.25)
    assert torch.equal(attn(x), plain)


def test_weight_rms_is_read_for_the_blocks_matrices_only(tmp_path):
    tensors = {"transformer.h.0.attn.c_proj.weight": torch.full((4, 4), 2.0),
               "transformer.h.1.attn.c_proj.weight": torch.full((4, 4), 4.0),
               "transformer.h.0.mlp.c_fc.weight": torch.tensor([[3.0, -3.0], [3.0, -3.0]]),
               "transformer.h.0.mlp.c_fc.bias": torch.ones(2), "transformer.wte.weight": torch.ones(8, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    rms = block_matrix_rms(tmp_path / "model.safetensors")
    assert rms == {"transformer.h.0.attn.c_proj.weight": 2.0, "transformer.h.0.mlp.c_fc.weight": 3.0,
                   "transformer.h.1.attn.c_proj.weight": 4.0}
    assert layer_kind("transformer.h.11.mlp.c_proj.weight") == (11, "mlp.c_proj")
    assert final_rms_by_kind([{"step": 5, "rms": rms}]) == {"attn.c_proj": 3.0, "mlp.c_fc": 3.0}


def test_each_seed_reads_a_window_of_the_corpus_of_its_own_and_all_share_the_validation_shards(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_shard(corpus / "bench_train_000000.bin", np.arange(0, 600, dtype=np.uint16))
    write_shard(corpus / "bench_train_000001.bin", np.arange(600, 1000, dtype=np.uint16))
    write_shard(corpus / "bench_val_000000.bin", np.full(50, 7, dtype=np.uint16))
    folders = seed_data_dirs(corpus, tmp_path / "runs", seeds=3, tokens=301)
    windows = [read_shard(find_shards(str(f), "train")[0]) for f in folders]
    assert [(int(w[0]), int(w[-1]), w.size) for w in windows] == [(0, 300, 301), (301, 601, 301), (602, 902, 301)]
    assert all(read_shard(find_shards(str(f), "val")[0]).tolist() == [7] * 50 for f in folders)
    assert seed_data_dirs(corpus, tmp_path / "runs", seeds=3, tokens=301) == folders  # written once, read again
    with pytest.raises(UserError, match="4 seeds x 301 tokens each is more than the corpus's 1,000"):
        seed_data_dirs(corpus, tmp_path / "runs", seeds=4, tokens=301)


def test_the_paired_interval_uses_students_t_with_one_less_degree_of_freedom_than_seeds():
    assert t_quantile_975(1) == pytest.approx(12.706, abs=2e-3)
    assert t_quantile_975(3) == pytest.approx(3.182, abs=1e-3)
    assert t_quantile_975(30) == pytest.approx(2.042, abs=1e-3)
    mean, half = paired_interval([-0.0147, -0.0294])  # the clip's two seeds in the 2-seed bench: not significant
    assert mean == pytest.approx(-0.02205) and half == pytest.approx(12.706 * 0.0103945 / math.sqrt(2), rel=1e-3)
    assert half > abs(mean)
    assert paired_interval([0.1])[1] == math.inf


def test_the_report_calls_an_arm_significant_only_where_its_interval_leaves_out_zero():
    finals = {"shipped": [3.90, 3.91, 3.92, 3.93], "worse": [4.00, 4.01, 4.03, 4.03],
              "noise": [3.91, 3.90, 3.93, 3.92], "better": [3.80, 3.82, 3.81, 3.83]}
    rms = {arm: {"mlp.c_fc": 0.04} for arm in finals}
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in report(finals, rms, 4).splitlines()[2:]}
    assert rows["worse"][3] == "yes, worse" and rows["better"][3] == "yes, better" and rows["noise"][3] == "no"
    assert rows["worse"][2].startswith("+0.1025 ± ") and rows["shipped"][2] == "—"
