"""Which linear layers an FP8 backend converts (hf_scale.knowledge.fp8_layers): torchao's own decision, said in the
line train.py logs and `hf-scale check` reports."""

from __future__ import annotations

import pytest
import torch

from hf_scale.knowledge import fp8_layers

torchao = pytest.importorskip("torchao")  # the test extra installs it; the kernels are never run here


def _llama(**sizes):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=1, vocab_size=128256, **sizes)
    with torch.device("meta"):  # shapes only: nothing is allocated
        return LlamaForCausalLM(config)


def test_which_layers_become_fp8_is_what_torchao_converts():
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    model = _llama(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    plan = fp8_layers.plan(model, "torchao")
    layer = "model.layers.0"
    assert sorted(plan.converted) == sorted(
        f"{layer}.{name}" for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                       "mlp.down_proj"))
    assert plan.kept == {"lm_head": "output head", f"{layer}.self_attn.k_proj": "below the backend's size threshold",
                         f"{layer}.self_attn.v_proj": "below the backend's size threshold"}
    convert_to_float8_training(model, module_filter_fn=fp8_layers.module_filter())
    assert sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear)) == sorted(plan.converted)
    line = fp8_layers.describe(plan)
    assert line == ("fp8 (torchao): 5 of 8 linear layers in fp8; kept in bf16: below the backend's size threshold: 2 "
                    "(model.layers.0.self_attn.k_proj, ...); output head: 1 (lm_head)")


def test_a_small_model_keeps_everything_in_bf16():
    from transformers import AutoModelForCausalLM

    from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR

    plan = fp8_layers.plan(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR), "torchao")
    assert not plan.converted and "lm_head" in plan.kept
