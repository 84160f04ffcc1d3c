"""Ranking and recommendation: the rule of thumb, rejections with reasons, and the chosen config is a valid
DistributedConfig whose DeepSpeed JSON DeepSpeed's own parser accepts."""

from __future__ import annotations

import pytest
from deepspeed.runtime.config import DeepSpeedConfig
from transformers import LlamaConfig

from hf_scale.contract.deepspeed_json import deepspeed_config
from hf_scale.planner import Workload, distributed_config, make_plan, model_shapes
from hf_scale.planner.rank import TIE

GIB = 2**30
SHAPES = {
    "0.5b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                 intermediate_size=2816, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256),
    "70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                intermediate_size=28672, vocab_size=128256),
}  # fmt: skip


@pytest.fixture(scope="module")
def shapes():
    return {name: model_shapes(LlamaConfig(**config), name=name) for name, config in SHAPES.items()}


def plan(shapes, name, *, machines=1, cpu=None, **workload):
    w = Workload(shapes[name], gpus_per_machine=8, num_machines=machines, seq_len=4096, micro_batch_size=1, **workload)
    return make_plan(w, gpu_memory=80 * GIB, cpu_memory=cpu)


def test_sub_1b_model_on_8x80gb_fits_everything_and_ddp_is_within_reach(shapes):
    p = plan(shapes, "0.5b")
    assert p.rejected_faster == () and all(a.fits for a in p.assessments if not a.candidate.offload_params)
    ddp = next(a for a in p.assessments if a.slug == "ddp")
    # DDP's fp32 all-reduce and unsharded optimizer step cost it a little against FSDP2's overlapped gathers
    assert ddp.time.tokens_per_s > 0.85 * p.recommended.time.tokens_per_s


def test_8b_full_fine_tune_on_8x80gb_gets_a_sharded_strategy_and_says_why_ddp_does_not_fit(shapes):
    p = plan(shapes, "8b")
    best = p.recommended.candidate
    assert best.zero_stage >= 2 or best.engine == "fsdp"
    reasons = {a.slug: a.reason for a in p.assessments}
    assert "needs 192.0 GiB per GPU > 72.0 GiB usable" in reasons["ddp"]
    assert all(not a.fits for a in p.rejected_faster)


def test_70b_on_8x80gb_needs_zero3_offload_when_the_cpu_ram_is_there(shapes):
    p = plan(shapes, "70b", cpu=2 * 1024 * GIB)
    best = p.recommended.candidate
    assert best.zero_stage == 3 and best.offload_optimizer


def test_70b_on_8x80gb_is_refused_with_reasons_when_cpu_ram_is_short(shapes):
    p = plan(shapes, "70b", cpu=512 * GIB)
    assert p.recommended is None
    assert len(p.rejected_faster) == len(p.assessments)
    offload = next(a for a in p.assessments if a.slug == "zero3_offload_ac")
    assert "CPU RAM per machine > 460.8 GiB usable" in offload.reason


def test_lora_lets_8b_run_with_plain_ddp(shapes):
    assert plan(shapes, "8b", lora_r=16).recommended.slug == "ddp"


def test_candidates_are_ordered_fastest_first_and_offload_comes_last(shapes):
    p = plan(shapes, "8b", machines=2)
    order = [a.slug for a in p.assessments]
    assert order.index("zero3") < order.index("zero3_offload_opt") < order.index("zero3_offload")
    assert order.index("fsdp2_full_shard") < order.index("fsdp2_full_shard_ac")  # recomputing costs time
    # fastest first, predictions closer than TIE being a tie that the list order decides
    speeds = [a.time.tokens_per_s for a in p.assessments]
    assert all(a >= b / (1 + TIE) ** 2 for a, b in zip(speeds, speeds[1:], strict=False))
    assert "fsdp2_hybrid_multinode" not in [a.slug for a in plan(shapes, "8b").assessments]


@pytest.mark.parametrize("machines", [1, 2])
def test_every_candidate_becomes_a_valid_config_deepspeed_accepts(shapes, machines):
    p = plan(shapes, "8b", machines=machines)
    for a in p.assessments:
        cfg = distributed_config(p, a)
        assert cfg.world_size == 8 * machines
        assert cfg.activation_checkpointing == a.candidate.activation_checkpointing
        if cfg.strategy == "deepspeed":
            assert cfg.deepspeed.zero_stage == a.candidate.zero_stage
            ds = deepspeed_config(cfg, "resolved")
            # DeepSpeedConfig checks the batch against this process's world of 1; the ZeRO block is the point.
            ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
            assert DeepSpeedConfig(ds).zero_optimization_stage == a.candidate.zero_stage
        if cfg.strategy == "fsdp":
            assert cfg.fsdp.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
