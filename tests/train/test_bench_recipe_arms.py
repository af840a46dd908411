"""scripts/bench_recipe_arms.py: the arms are the shipped settings with one change each, the attention scale
multiplies every attention output, and the weight RMS is read per block matrix."""

import json

import pytest
import torch
from safetensors.torch import save_file

from scripts.bench_recipe_arms import (
    attention_output_scaled,
    block_matrix_rms,
    final_rms_by_kind,
    layer_kind,
    recipe_arms,
    shipped_settings,
)
from shared.config import ModelConfig, TrainConfig
from shared.train.model import GPT


def test_the_shipped_arm_is_the_example_files_optimizer_and_schedule(tmp_path):
    example = json.loads(open("examples/chain-gpt2-124m-muon.json").read())["train"]
    shipped = shipped_settings()
    assert {k: shipped[k] for k in shipped if k in example} == {k: example[k] for k in shipped if k in example}
    assert shipped["aux_lr"] == TrainConfig().aux_lr  # left out of the example: the trainer's default
    changed = tmp_path / "example.json"
    changed.write_text(json.dumps({"train": {**example, "muon_lr": 0.0009}}))
    assert shipped_settings(changed)["muon_lr"] == 0.0009


def test_each_arm_changes_only_its_own_settings():
    shipped = shipped_settings()
    arms = recipe_arms(shipped, steps=500, n_layer=4)
    assert list(arms) == ["shipped", "aux-lr-6e-4", "warmup", "muon-decay", "attn-scale", "no-clip",
                          "adamw-build-nanogpt"]
    changes = {name: {k: v for k, v in settings.items() if shipped[k] != v} for name, (settings, _) in arms.items()}
    assert changes["shipped"] == {} and changes["attn-scale"] == {}
    assert changes["aux-lr-6e-4"] == {"lr": 6e-4, "aux_lr": 6e-4}
    assert changes["warmup"] == {"warmup_steps": 19}  # 715 of 19,073 steps
    assert changes["muon-decay"] == {"muon_weight_decay": round(0.5 * 13352 / 500, 4)}
    assert changes["no-clip"] == {"grad_clip": 0.0}  # the example clips at 1.0: the arm is the other side
    assert changes["adamw-build-nanogpt"] == {"optimizer": "adamw", "lr": 6e-4, "weight_decay": 0.1,
                                              "schedule": "cosine", "warmup_steps": 19}
    unclipped = recipe_arms({**shipped, "grad_clip": 0.0}, steps=500, n_layer=4)  # as the bench ran it
    assert "clip" in unclipped and unclipped["clip"][0]["grad_clip"] == 1.0
    assert arms["attn-scale"][1] == pytest.approx(8 ** -0.5) and {a[1] for n, a in arms.items() if n != "attn-scale"} \
        == {1.0}
    for settings, _ in arms.values():  # every arm is a config the trainer accepts
        TrainConfig(**settings, max_steps=500)


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
