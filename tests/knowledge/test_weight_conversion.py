"""transformers' checkpoint conversion, one tensor at a time (train/checkpoint/weight_conversion.py): a
mixture-of-experts model's fused experts map to the per-expert tensors save_pretrained writes, and back, exactly;
a tensor kept as saved maps to itself."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from train_helpers import tiny_moe

from hf_scale.knowledge.weight_conversion import Loader, saved_form

FUSED = "model.layers.1.mlp.experts.gate_up_proj"


def test_fused_experts_are_saved_per_expert_and_put_together_again(tmp_path):
    model, _ = tiny_moe()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    live = model.state_dict()[FUSED]  # [experts, 2 x moe_intermediate, hidden]
    pieces = saved_form(model, FUSED, live)
    assert sorted(pieces) == sorted(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight"
                                    for e in range(4) for p in ("gate", "up"))
    for name, piece in pieces.items():  # what save_pretrained wrote, bit for bit
        assert torch.equal(piece, saved[name]), name
    assert torch.equal(Loader(model).runtime_tensor(FUSED, {name: saved[name] for name in pieces}), live)


def test_a_tensor_kept_as_saved_is_its_own_piece():
    model, _ = tiny_moe()
    weight = model.model.norm.weight
    assert list(saved_form(model, "model.norm.weight", weight)) == ["model.norm.weight"]
    meta = saved_form(model, FUSED, model.state_dict()[FUSED].to("meta"))  # names and shapes without values
    assert {tuple(t.shape) for t in meta.values()} == {(32, 64)}
