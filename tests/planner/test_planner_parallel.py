"""hf_scale.planner.parallel: FSDP2 x TP / x CP (and HSDP x TP) candidates in `hf-scale plan`. The expectations
are derived from the model's shapes with the estimate's own formulas (what no data-parallel layout can hold),
not copied from the planner's output."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from transformers import LlamaConfig

from hf_scale.cli import main
from hf_scale.planner import Workload, activation_bytes, estimate, logits_bytes, make_plan, model_shapes
from hf_scale.planner.estimate import Candidate

GIB = 2**30
LLAMA_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 intermediate_size=28672, vocab_size=128256)
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256)


def workload(config: dict, seq_len: int, machines: int = 1, **shape) -> Workload:
    shapes = model_shapes(LlamaConfig(**{**config, **shape}), name="m")
    return Workload(shapes, gpus_per_machine=8, num_machines=machines, seq_len=seq_len, micro_batch_size=1)


def test_70b_at_32k_on_8x80gib_needs_tp_or_cp():
    w = workload(LLAMA_70B, 32768)
    plan = make_plan(w, gpu_memory=80 * GIB, cpu_memory=2048 * GIB)
    # What every data-parallel layout holds on each GPU whatever it shards or offloads: one whole sequence's
    # checkpointed activations and its logits.
    floor = logits_bytes(w) + activation_bytes(w, checkpointing=True)
    assert floor > plan.gpu_budget
    for a in plan.assessments:
        if a.candidate.tp == a.candidate.cp == 1:
            assert not a.fits, a.slug
    best = plan.recommended.candidate
    assert best.tp * best.cp > 1
    assert plan.recommended.estimate.gpu_total <= plan.gpu_budget


def test_8b_at_128k_on_8x80gib_needs_cp_because_tp_does_not_split_the_logits():
    w = workload(LLAMA_8B, 131072)
    plan = make_plan(w, gpu_memory=80 * GIB)
    # lm_head gathers its output on every TP rank: only splitting the sequence divides the logits.
    needed_cp = math.ceil(logits_bytes(w) / plan.gpu_budget)
    assert needed_cp > 1
    best = plan.recommended.candidate
    assert best.cp >= needed_cp
    assert all(not a.fits for a in plan.assessments if a.candidate.cp < needed_cp)


def test_memory_is_split_over_dp_shard_x_tp_and_activations_over_tp_and_cp():
    w = workload(LLAMA_8B, 8192)
    full = estimate(w, Candidate("fsdp2_full_shard", "", "fsdp"))
    tp2 = estimate(w, Candidate("fsdp2_tp2", "", "fsdp", tp=2))
    cp2 = estimate(w, Candidate("fsdp2_cp2", "", "fsdp", cp=2))
    # 8 GPUs hold one copy of the model states in every layout (dp_shard x cp x tp = 8).
    for e in (tp2, cp2):
        assert abs(e.model_states - full.model_states) <= 8
    assert cp2.logits == full.logits // 2 and tp2.logits == full.logits
    assert cp2.activations == pytest.approx(full.activations / 2, abs=1)
    assert full.activations / 2 < tp2.activations < full.activations  # the norms' inputs stay whole under TP


def test_tp_stays_inside_a_machine_and_splits_whole_heads():
    w = workload(LLAMA_8B, 4096, machines=2, num_attention_heads=4, num_key_value_heads=4, hidden_size=512,
                 intermediate_size=1024)
    offered = {c.tp for c in (a.candidate for a in make_plan(w, gpu_memory=80 * GIB).assessments)}
    assert offered == {1, 2, 4}  # 8 would split 4 heads; 16 would cross machines


def test_plan_json_carries_the_sizes_and_generate_writes_them(tmp_path, capsys):
    model = tmp_path / "llama8b.json"
    model.write_text(json.dumps({"model_type": "llama", **LLAMA_8B}))
    flags = ["--gpus-per-machine", "8", "--gpu-memory", "80GiB", "--seq-len", "131072"]
    assert main(["plan", str(model), "--json", *flags]) == 0
    payload = json.loads(capsys.readouterr().out)
    best = next(c for c in payload["candidates"] if c["key"] == payload["recommended"])
    sizes = best["parallelism"]
    assert sizes["cp"] > 1 and sizes["dp_shard"] * sizes["cp"] * sizes["tp"] == 8
    assert payload["recommended_config"]["parallelism"]["cp"] == sizes["cp"]
    out = tmp_path / "out"
    assert main(["generate", "--strategy", "auto", "--model", str(model), *flags, "--output-dir", str(out)]) == 0
    capsys.readouterr()
    (accelerate_yaml,) = Path(out / "accelerate_configs").glob("*.yaml")
    block = yaml.safe_load(accelerate_yaml.read_text())["parallelism_config"]
    assert block["parallelism_config_cp_size"] == sizes["cp"]
    assert block["parallelism_config_dp_shard_size"] == sizes["dp_shard"]
