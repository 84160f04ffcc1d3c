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

from hf_scale.commands.cli import main
from hf_scale.planner import Workload, activation_bytes, estimate, logits_bytes, make_plan, model_shapes
from hf_scale.planner.estimate import Candidate

GIB = 2**30
LLAMA_70B = dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                 intermediate_size=28672, vocab_size=128256)
LLAMA_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072)


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
    tp2 = estimate(w, Candidate("fsdp2_tp", "", "fsdp", tp=2))
    cp2 = estimate(w, Candidate("fsdp2_cp", "", "fsdp", cp=2))
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


def _offered_tp(w: Workload) -> set[int]:
    return {a.candidate.tp for a in make_plan(w, gpu_memory=80 * GIB).assessments}


def test_hsdp_x_tp_on_two_machines_shards_inside_a_machine_and_replicates_across(tmp_path, capsys):
    """HSDP x TP: FSDP2 shards over dp_shard x tp inside each machine and replicates across the machines, so each GPU
    holds twice the model states of FSDP2 x TP over both machines; its config is dp_replicate=2 x dp_shard x tp."""
    w = workload(LLAMA_70B, 8192, machines=2)
    plan = make_plan(w, gpu_memory=80 * GIB, cpu_memory=2048 * GIB)
    by_slug = {a.slug: a for a in plan.assessments}
    hybrid = next(a for slug, a in by_slug.items() if slug.removesuffix("_ac") == "fsdp2_hybrid_tp")
    flat = next(a for slug, a in by_slug.items() if slug.removesuffix("_ac") == "fsdp2_tp")
    assert hybrid.candidate.hybrid and hybrid.candidate.tp == 2
    assert hybrid.estimate.model_states == pytest.approx(2 * flat.estimate.model_states, rel=1e-6)
    # tp 8 would leave dp_shard=1 inside a machine
    assert {a.candidate.tp for a in plan.assessments if a.candidate.hybrid and a.candidate.tp > 1} == {2, 4}
    model = tmp_path / "llama70b.json"
    model.write_text(json.dumps({"model_type": "llama", **LLAMA_70B}))
    assert main(["plan", str(model), "--json", "--gpus-per-machine", "8", "--num-machines", "2", "--gpu-memory",
                 "80GiB", "--cpu-memory", "2TiB", "--seq-len", "8192"]) == 0
    payload = json.loads(capsys.readouterr().out)
    sizes = next(c["parallelism"] for c in payload["candidates"] if c["key"].removesuffix("_ac") == "fsdp2_hybrid_tp")
    assert sizes == {"dp_replicate": 2, "dp_shard": 4, "tp": 2, "cp": 1, "sp": 1}


def test_tp_that_divides_the_heads_is_not_offered_across_machines_and_refused_when_set(tmp_path, capsys):
    """tp=8 divides Llama-70B's 64 heads and 8 KV heads, but on machines of 4 GPUs its group would span two: not a
    candidate, and a config that asks for it is refused in one line (allowed with tp_across_machines, warned)."""
    w = Workload(model_shapes(LlamaConfig(**LLAMA_70B), name="m"), gpus_per_machine=4, num_machines=2, seq_len=8192,
                 micro_batch_size=1)
    assert _offered_tp(w) <= {1, 2, 4} and 4 in _offered_tp(w)
    sets = ["--set", "topology.processes_per_machine=4", "--set", "topology.num_machines=4", "--set",
            "topology.main_process_ip=10.0.0.1", "--set", "parallelism.tp=8"]
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--preset", "fsdp2_tp", *sets, "--output-dir", str(tmp_path / "refused")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "parallelism.tp=8 does not fit inside one machine of 4 processes" in err
    assert not (tmp_path / "refused").exists()
    assert main(["generate", "--preset", "fsdp2_tp", *sets, "--set", "parallelism.tp_across_machines=true",
                 "--output-dir", str(tmp_path / "allowed")]) == 0
    assert "TP's all-reduces of every layer cross the machines' link" in capsys.readouterr().err


def test_tp8_on_one_8_gpu_machine_is_no_fsdp2_candidate():
    """TP=8 on 8 GPUs leaves FSDP2 no data-parallel rank to shard over (dp_shard=1): not an FSDP2 x TP candidate. Pure
    TP=8 (strategy ddp) holds the same model states per GPU as FSDP2 over 8 and does not split the logits, so the
    planner leaves it to --set; on two machines tp=8 keeps a dp_shard of 2 and is offered."""
    assert _offered_tp(workload(LLAMA_70B, 8192)) == {1, 2, 4}
    assert 8 in _offered_tp(workload(LLAMA_70B, 8192, machines=2))


def test_generate_refuses_set_sizes_that_do_not_split_the_planned_models_heads(tmp_path, capsys):
    model = tmp_path / "llama8b.json"
    model.write_text(json.dumps({"model_type": "llama", **LLAMA_8B, "num_key_value_heads": 2}))
    argv = ["generate", "--strategy", "auto", "--model", str(model), "--gpus-per-machine", "8", "--gpu-memory",
            "80GiB", "--seq-len", "4096", "--set", "strategy=fsdp", "--set", "fsdp.version=2", "--set",
            "parallelism.tp=4", "--output-dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    assert "--set parallelism.tp=4 does not divide the model's num_key_value_heads=2" in err
    assert not (tmp_path / "out").exists()
