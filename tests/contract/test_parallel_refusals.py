"""What train.py refuses of a parallel layout before anything is built, in its own words
(hf_scale.contract.parallel_refusals): train.py's start, `hf-scale check` and `hf-scale generate` ask these
functions."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, MistralConfig

from hf_scale.config.parallelism import Layout
from hf_scale.contract import parallel_refusals

CP2 = Layout(dp_shard=2, cp=2)


@pytest.mark.parametrize(("flags", "fragment"), [
    ({"packing": True, "attn_implementation": "auto"}, "cp=2 with --packing: ring attention takes no document mask"),
    ({"packing": False, "attn_implementation": "flash_attention_2"}, "shards only SDPA attention"),
])
def test_flags_context_parallelism_cannot_run_are_refused(flags, fragment):
    assert fragment in parallel_refusals.cp_flag_refusal(CP2, where="parallelism", **flags)
    assert parallel_refusals.cp_flag_refusal(CP2, packing=False, attn_implementation="auto", where="p") is None
    assert parallel_refusals.cp_flag_refusal(Layout(dp_shard=2), packing=True, attn_implementation="eager",
                                             where="p") is None


def test_attention_stricter_than_causal_is_refused_before_the_model_loads():
    assert "sliding_attention" in parallel_refusals.cp_model_refusal(CP2, MistralConfig(sliding_window=4096), "p")
    assert parallel_refusals.cp_model_refusal(CP2, MistralConfig(sliding_window=None), "p") is None
    assert parallel_refusals.cp_model_refusal(CP2, LlamaConfig(), "p") is None
    assert parallel_refusals.cp_model_refusal(Layout(dp_shard=2), MistralConfig(sliding_window=4096), "p") is None


def test_sequence_parallelism_refuses_a_model_whose_router_adds_an_auxiliary_loss():
    """sp's loss path computes the token loss from the shards: a router aux loss (output_router_logits) would be
    dropped without a word, so the layout is refused where every other model problem is (before the model loads)."""
    from transformers import Qwen3MoeConfig

    from hf_scale.config.parallelism import Layout
    from hf_scale.contract.parallel_refusals import model_problem

    moe = Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)
    assert model_problem(Layout(sp=2), moe, "parallelism") is None  # no router loss asked for
    moe.output_router_logits = True
    assert model_problem(Layout(sp=2), moe, "parallelism") == (
        "parallelism.sp=2 with a model whose router adds an auxiliary loss (output_router_logits: true in its "
        "config): sequence parallelism would train without that loss; use sp=1 or set output_router_logits to false")
    assert model_problem(Layout(dp_shard=2), moe, "parallelism") is None  # without sp the loops add it
