"""The planner's candidates are the strategy catalogue's entries (hf_scale.config.presets), under the catalogue's names:
`plan --json` on a topology and model that admit every planned entry lists each of them, at each size by the
sized_name rule, and nothing else; a setup found elsewhere (a calibrated run) gets the catalogue's name."""

from __future__ import annotations

import json

from hf_scale.commands.cli import main
from hf_scale.config.presets import PRESETS, sized_name
from hf_scale.planner.estimate import Candidate
from hf_scale.planner.parallel import SIZES
from hf_scale.planner.strategies import candidate, named

# A small Qwen3-MoE (transformers has an expert-parallel plan for it): 8 heads and 8 experts split at every size.
TINY_MOE = dict(model_type="qwen3_moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, head_dim=32, num_experts=8,
                num_experts_per_tok=2, vocab_size=1000, max_position_embeddings=512)


def catalogue_names() -> dict[str, str]:
    """Every name the planner may give, mapped to its catalogue entry: each planned entry's own name, and the varied
    ones at each of the planner's sizes, with and without activation checkpointing."""
    names = {}
    for entry in PRESETS.values():
        if entry.planned is None:
            continue
        sizes = SIZES if entry.planned.vary else (None,)
        for size in sizes:
            key = sized_name(entry.name, entry.planned.vary, size) if size else entry.name
            names[key] = names[key + "_ac"] = entry.name
    return names


def test_plan_json_lists_every_planned_catalogue_entry_under_the_catalogues_names(tmp_path, capsys):
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY_MOE))
    assert main(["plan", str(model), "--json", "--gpus-per-machine", "8", "--num-machines", "2",
                 "--gpu-memory", "80GiB", "--seq-len", "256"]) == 0
    payload = json.loads(capsys.readouterr().out)
    keys = [c["key"] for c in payload["candidates"]]
    names = catalogue_names()
    assert len(keys) == len(set(keys)), "two candidates under one name"
    assert [key for key in keys if key not in names] == []  # every candidate is a catalogue entry
    planned = {name for name, entry in PRESETS.items() if entry.planned is not None}
    assert {names[key] for key in keys} == planned  # and every planned entry is a candidate
    assert payload["recommended"] in names
    # sizes: fsdp2_tp is tp=2 (the preset itself), fsdp2_tp4 tp=4; checkpointing adds _ac
    by_key = {c["key"]: c for c in payload["candidates"]}
    assert by_key["fsdp2_tp"]["parallelism"]["tp"] == 2 and by_key["fsdp2_tp4_ac"]["parallelism"]["tp"] == 4
    assert {"zero3_offload", "zero3_offload_opt", "fsdp2_hybrid_multinode", "fsdp2_ep8_offload"} <= set(keys)


def test_a_catalogue_entry_and_its_candidate_are_one_setup():
    """What the planner estimates of an entry is read from the entry's config: the preset zero3_offload offloads
    parameters and optimizer, and so does the planner's zero3_offload."""
    c = candidate("zero3_offload")
    assert (c.key, c.zero_stage, c.offload_optimizer, c.offload_params) == ("zero3_offload", 3, True, True)
    assert candidate("fsdp2_hybrid_tp", 4).key == "fsdp2_hybrid_tp4" and candidate("fsdp2_hybrid_tp", 4).hybrid
    assert candidate("fsdp2_cp_offload", 8).key == "fsdp2_cp8_offload"


def test_a_setup_found_elsewhere_gets_the_catalogues_name():
    assert named(Candidate("x", "x", "fsdp", hybrid=True)).key == "fsdp2_hybrid_multinode"
    assert named(Candidate("x", "x", "fsdp", tp=4)).key == "fsdp2_tp4"
    assert named(Candidate("x", "x", "deepspeed", zero_stage=3)).key == "zero3"
    both = Candidate("fsdp2_tp2cp2", "FSDP2 x TP=2 x CP=2", "fsdp", tp=2, cp=2)
    assert named(both) == both  # no catalogue entry splits tp and cp together
