"""Exact parameter counts on the meta device and the memory formulas: known shapes, DeepSpeed's own
estimators, and how precision, optimizer, LoRA and activation checkpointing move the numbers."""

from __future__ import annotations

import json

import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
from transformers import LlamaConfig

from hf_scale.errors import UserError
from hf_scale.planner import Candidate, Workload, activation_bytes, estimate, logits_bytes, model_shapes

LLAMA_31_8B = dict(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    intermediate_size=14336,
    vocab_size=128256,
    tie_word_embeddings=False,
)
DDP = Candidate("ddp", "DDP", "ddp")
ZERO2 = Candidate("zero2", "ZeRO-2", "deepspeed", zero_stage=2)
ZERO2_OFF = Candidate("zero2_offload", "", "deepspeed", zero_stage=2, offload_optimizer=True)
ZERO3 = Candidate("zero3", "ZeRO-3", "deepspeed", zero_stage=3)
ZERO3_OFF = Candidate("zero3_offload_opt", "", "deepspeed", zero_stage=3, offload_optimizer=True)
ZERO3_OFF_ALL = Candidate("z3all", "", "deepspeed", zero_stage=3, offload_optimizer=True, offload_params=True)


@pytest.fixture(scope="module")
def llama8b():
    return model_shapes(LlamaConfig(**LLAMA_31_8B), name="llama-3.1-8b-shapes")


def workload(shapes, **overrides):
    values = dict(gpus_per_machine=8, num_machines=1, seq_len=4096, micro_batch_size=1)
    return Workload(shapes, **{**values, **overrides})


def test_llama_31_8b_shapes_count_8_030_261_248_parameters_from_a_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", **LLAMA_31_8B}))
    shapes = model_shapes(str(path))
    assert shapes.total_params == 8_030_261_248
    assert shapes.decoder_layer_class == "LlamaDecoderLayer"
    assert shapes.num_layers == 32
    assert shapes.largest_layer_params == 128256 * 4096  # embed_tokens (= lm_head)
    # A model directory holding the same config.json gives the same count.
    assert model_shapes(str(tmp_path)).total_params == 8_030_261_248


def test_tied_embeddings_are_counted_once(llama8b):
    tied = model_shapes(LlamaConfig(**{**LLAMA_31_8B, "tie_word_embeddings": True}))
    assert llama8b.total_params - tied.total_params == 128256 * 4096


def test_config_json_without_model_type_is_a_one_line_user_error(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"hidden_size": 8}')
    with pytest.raises(UserError, match='has no "model_type"'):
        model_shapes(str(path))


@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_ddp_model_states_are_16_bytes_per_parameter_with_adamw(llama8b, precision):
    e = estimate(workload(llama8b, precision=precision), DDP)
    assert e.model_states == 16 * llama8b.total_params


def test_optimizer_choice_changes_the_optimizer_states(llama8b):
    states = {
        name: estimate(workload(llama8b, optimizer=name), DDP).optimizer for name in ("adamw", "adamw_8bit", "sgd")
    }
    assert states == {"adamw": 8 * llama8b.total_params, "adamw_8bit": 2 * llama8b.total_params, "sgd": 0}


def test_lora_keeps_gradients_and_optimizer_states_for_the_adapters_only(llama8b):
    lora = workload(llama8b, lora_r=16)
    adapters = 16 * sum(32 * (4096 + out) for out in (4096, 1024, 1024, 4096)) + 16 * 32 * (
        2 * (4096 + 14336) + (14336 + 4096)
    )  # q, k, v, o + gate, up, down in every layer
    assert lora.trainable_params == adapters == 41_943_040
    e = estimate(lora, DDP)
    assert e.grads == 4 * adapters and e.optimizer == 8 * adapters
    assert e.params == 4 * adapters + 2 * llama8b.total_params  # frozen base in bf16
    assert e.model_states < estimate(workload(llama8b), DDP).model_states / 5


def test_mixed_precision_halves_deepspeed_working_weights(llama8b):
    bf16 = estimate(workload(llama8b), ZERO2)
    fp32 = estimate(workload(llama8b, precision="no"), ZERO2)
    assert fp32.params == 2 * bf16.params == 4 * llama8b.total_params
    assert fp32.optimizer == bf16.optimizer  # the fp32 master + states do not depend on precision


def test_zero2_matches_deepspeeds_estimator(llama8b):
    # DeepSpeed: 2 + 18/N bytes per parameter on the GPU; here 2 (params) + 2/N (grads) + 12/N (master and
    # states) + the 4/N step-time fp32 gradient partition (in buffers).
    w = workload(llama8b, gpus_per_machine=4)
    p = llama8b.total_params
    _, ds_gpu = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=4, cpu_offload=False)
    e = estimate(w, ZERO2)
    assert e.model_states + 4 * p // 4 == ds_gpu
    ds_cpu, ds_gpu = estimate_zero2_model_states_mem_needs(
        p, num_gpus_per_node=4, cpu_offload=True, additional_buffer_factor=1
    )
    off = estimate(w, ZERO2_OFF)
    assert off.model_states == ds_gpu == 2 * p
    assert off.cpu_per_machine == ds_cpu == 16 * p


def test_zero3_offload_cpu_memory_matches_deepspeeds_estimator_and_gpu_differs_as_documented(llama8b):
    w = workload(llama8b)
    p, largest = llama8b.total_params, llama8b.largest_layer_params
    both = dict(num_gpus_per_node=8, additional_buffer_factor=1, zero_init=True)
    ds_cpu, _, _ = estimate_zero3_model_states_mem_needs(p, largest, cpu_offload=True, cpu_offload_params=True, **both)
    assert estimate(w, ZERO3_OFF_ALL).cpu_per_machine == ds_cpu == 18 * p
    ds_cpu, ds_gpu, live = estimate_zero3_model_states_mem_needs(
        p, largest, cpu_offload=True, cpu_offload_params=False, **both
    )
    off = estimate(w, ZERO3_OFF)
    assert off.cpu_per_machine == ds_cpu == 16 * p
    persistent = sum(n for n in llama8b.param_numels if n < 10 * 4096)  # the RMSNorm weights
    assert off.params - 2 * persistent == ds_gpu - live == 2 * p // 8
    # Without offload DeepSpeed's 18/N leaves out the 16-bit gradient partition (2/N) that the engine holds
    # (tests/planner/test_planner_deepspeed.py measures it) and the 4/N fp32 step copy is in buffers here.
    _, ds_gpu, live = estimate_zero3_model_states_mem_needs(p, largest, cpu_offload=False, **both)
    on = estimate(w, ZERO3)
    assert on.model_states - 2 * persistent - 2 * p // 8 + 4 * p // 8 == ds_gpu - live


def test_activation_checkpointing_keeps_only_layer_inputs(llama8b):
    w = workload(llama8b)
    full, checkpointed = activation_bytes(w, checkpointing=False), activation_bytes(w, checkpointing=True)
    # Llama-3.1-8B, bf16: 2(4+2)h + 2(2h + 2kv) + 8i = 184,320 bytes per token per layer.
    assert full == (32 * 184_320 + 6 * 4096) * 4096
    assert checkpointed == (32 * 2 * 4096 + 184_320) * 4096
    doubled = workload(llama8b, micro_batch_size=2)
    assert activation_bytes(doubled, checkpointing=False) == 2 * full


def test_logits_are_vocab_times_tokens_in_fp32_twice_plus_the_16_bit_output(llama8b):
    assert logits_bytes(workload(llama8b)) == 4096 * 128256 * (2 + 4 + 4)
