"""The planner on mixture-of-experts models (issue 35): the shapes measured on the meta model (routed experts, active
parameters), FSDP2 x EP memory (model states split over every rank as under FSDP2, a layer gathering 1/ep of its
experts, the dispatch buffers), the all-to-all term that grows with ep, and the recommendation with its reason for
a Qwen3-30B-A3B-sized and a Mixtral-8x7B-sized model on 8 x 80 GiB.

The shapes: Qwen3-30B-A3B's config.json (huggingface.co/Qwen/Qwen3-30B-A3B; its totals, 30.5B parameters and 3.3B
activated, 48 layers, 32/4 heads, 128 experts with 8 activated, are Table 2 of the Qwen3 Technical Report,
arXiv:2505.09388); Mixtral-8x7B: Table 1 of "Mixtral of Experts" (arXiv:2401.04088: dim 4096, 32 layers, 32/8 heads,
hidden 14336, 8 experts, top 2, vocabulary 32000; "47B parameters, 13B active" in its section 2)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

from hf_scale.planner import Candidate, Workload, estimate, model_shapes
from hf_scale.planner.hardware import hardware
from hf_scale.planner.rank import candidates, distributed_config, make_plan
from hf_scale.planner.report import expert_lines, format_plan_table
from hf_scale.planner.time_model import all_to_all_s, step_time

GIB = 2**30
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False)
MIXTRAL_8X7B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                    max_position_embeddings=32768, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def qwen3():
    return model_shapes(Qwen3MoeConfig(**QWEN3_30B_A3B), name="qwen3-30b-a3b-shapes")


@pytest.fixture(scope="module")
def mixtral():
    return model_shapes(MixtralConfig(**MIXTRAL_8X7B), name="mixtral-8x7b-shapes")


def workload(shapes, **overrides) -> Workload:
    return Workload(shapes, **{"gpus_per_machine": 8, "num_machines": 1, "seq_len": 4096, "micro_batch_size": 1,
                               **overrides})


def test_the_routed_experts_and_the_active_parameters_are_the_published_ones(qwen3, mixtral):
    assert (qwen3.num_experts, qwen3.experts_per_token, qwen3.moe_layers) == (128, 8, 48)
    assert round(qwen3.total_params / 1e9, 1) == 30.5 and round(qwen3.active_params / 1e9, 1) == 3.4
    assert qwen3.expert_width == 768 and qwen3.mlp_width == 8 * 768
    assert (mixtral.num_experts, mixtral.experts_per_token) == (8, 2)
    assert round(mixtral.total_params / 1e9) == 47 and round(mixtral.active_params / 1e9) == 13
    assert mixtral.mlp_width == 2 * 14336  # Mixtral's experts are the dense MLP's width, two per token
    dense = model_shapes(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                     num_attention_heads=4, vocab_size=1000), name="dense")
    assert not dense.is_moe and dense.active_params == dense.total_params and dense.mlp_width == 512


def test_ep_keeps_the_model_states_of_fsdp2_and_gathers_1_over_ep_of_the_experts(qwen3):
    w = workload(qwen3)
    fsdp2 = estimate(w, Candidate("fsdp2_full_shard", "", "fsdp"))
    by_ep = {ep: estimate(w, Candidate(f"ep{ep}", "", "fsdp", ep=ep)) for ep in (2, 4, 8)}
    for e in by_ep.values():
        # each expert lives on ep x efsdp = 8 ranks: the model states per GPU are FSDP2's (rounding aside)
        assert e.model_states == pytest.approx(fsdp2.model_states, abs=16)
        assert e.activations == fsdp2.activations
    # the buffers: the dense layer and 1/ep of its experts gathered twice in 16 bits and once in fp32, + dispatch
    layer_experts = qwen3.expert_layer_params
    for ep in (2, 4):
        saved = (2 * 2 + 4) * (layer_experts // ep - layer_experts // (2 * ep))
        dispatch = 2 * 2 * 4096 * 8 * 2048
        assert by_ep[ep].buffers - by_ep[2 * ep].buffers == saved
        assert by_ep[ep].buffers - dispatch < fsdp2.buffers
    # the MoE activations are the active experts' plus router and dispatch, not the dense intermediate_size's
    moe = replace(qwen3, num_experts=None, expert_params=0)
    assert estimate(w, Candidate("f", "", "fsdp")).activations > estimate(replace(w, shapes=moe),
                                                                            Candidate("f", "", "fsdp")).activations


def test_the_all_to_all_grows_with_ep_and_crosses_the_slow_link_past_a_machine(qwen3):
    w, h100 = workload(qwen3), hardware()
    tokens = 4096
    times = [all_to_all_s(w, Candidate("e", "", "fsdp", ep=ep), h100, tokens) for ep in (1, 2, 4, 8)]
    assert times[0] == 0.0 and times[1] < times[2] < times[3]
    two = workload(qwen3, gpus_per_machine=4, num_machines=2)
    assert all_to_all_s(two, Candidate("e", "", "fsdp", ep=8), h100, tokens) > 3 * times[3]
    # the step pays it (not hidden), and FSDP gathers less of the experts as ep grows
    step = {ep: step_time(w, Candidate("e", "", "fsdp", ep=ep), h100) for ep in (2, 8)}
    assert step[8].communication_total_s < step[2].communication_total_s
    dense = replace(qwen3, num_experts=None, expert_params=0)
    assert all_to_all_s(replace(w, shapes=dense), Candidate("e", "", "fsdp", ep=8), h100, tokens) == 0.0


def test_ep_candidates_only_for_a_full_fine_tune_of_an_moe_model_inside_one_machine(qwen3, mixtral):
    eps = {c.ep for c in candidates(workload(qwen3), "off")}
    assert eps == {1, 2, 4, 8}
    assert {c.ep for c in candidates(workload(qwen3, lora_r=16), "off")} == {1}
    # 4 GPUs per machine: ep=8 would leave the machine
    assert {c.ep for c in candidates(workload(mixtral, gpus_per_machine=4, num_machines=2), "off")} == {1, 2, 4}


def test_plan_recommends_ep8_for_qwen3_30b_a3b_on_8_x_80gib_and_says_why(qwen3):
    plan = make_plan(workload(qwen3), gpu_memory=80 * GIB)
    best = plan.recommended
    assert (best.candidate.ep, best.candidate.activation_checkpointing) == (8, True)
    cfg = distributed_config(plan, best)
    assert (cfg.strategy, cfg.layout.dp_shard, cfg.layout.ep) == ("fsdp", 8, 8)
    lines = expert_lines(plan)
    assert lines[0].startswith("mixture of experts: 128 routed experts per layer, 8 per token: 3,353,032,704 of "
                               "30,532,122,624 parameters active")
    assert lines[1].startswith("  why ep=8: each expert's GEMM gets the tokens routed to it from 8 GPUs (2,048 rows "
                               "instead of 256), each GPU gathers 1/8 of a layer's experts")
    assert "ep=4: " in lines[1] and "ep=1: " in lines[1]
    assert "why ep=8" in format_plan_table(plan)


def test_plan_recommends_an_ep_for_mixtral_8x7b_with_8_bit_adam_and_says_why_not_with_adamw(mixtral):
    """Full AdamW of 47B is 16 bytes per parameter over 8 GPUs (87 GiB each): only CPU offload fits, where ZeRO-3's
    optimizer offload is predicted faster; with 8-bit AdamW (10 bytes) FSDP2 x EP fits, at ep=4 (ep=8 ties it)."""
    plan = make_plan(workload(mixtral), gpu_memory=80 * GIB)
    assert plan.recommended.candidate.ep == 1
    (why,) = expert_lines(plan)[1:]
    assert why.startswith("  no ep: ZeRO-3 + opt offload predicts ") and "FSDP2 x EP=" in why
    plan = make_plan(workload(mixtral, optimizer="adamw_8bit"), gpu_memory=80 * GIB)
    assert plan.recommended.candidate.ep == 4
    lines = expert_lines(plan)
    assert lines[1].startswith("  why ep=4: each expert's GEMM gets the tokens routed to it from 4 GPUs (4,096 rows "
                               "instead of 1,024)")
    assert lines[2] == "  ep=8 predicts within 2% (a tie): the smaller ep, with fewer all-to-all peers, is recommended"
