"""Context parallelism (hf_scale/train/model/context_parallel.py) on CPU, everything up to the ring kernel (which
torch 2.13 has no CPU implementation of: train.py refuses cp without a GPU, tests/train/test_train_bad_input.py):
the ParallelismConfig train.py hands accelerate, the collator, the refusals, and with real processes (gloo,
cp_shard_worker.py) accelerate's data split, torch's in-place sharding of every buffer, and the loss rule's
gradients against one process. The cp=2 train.py run against one process is benchmarks/gpu_cp.py (2 GPUs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_helpers import child_env, run, torchrun
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_scale.config.parallelism import Layout, train_refusal
from hf_scale.contract.embedded_assets import EMBEDDED_MODEL_DIR
from hf_scale.train.data.batches import count_target_tokens, make_collator
from hf_scale.train.data.packing import model_inputs
from hf_scale.train.model import context_parallel
from hf_scale.train.setup import guard

WORKER = Path(__file__).with_name("cp_shard_worker.py")
CP2 = Layout(dp_shard=2, cp=2)


def test_the_accelerator_gets_accelerates_parallelism_config_for_fsdp2_over_dp_shard_x_cp():
    config = context_parallel.accelerate_config(CP2, "alltoall")
    assert (config.dp_replicate_size, config.dp_shard_size, config.cp_size, config.tp_size, config.sp_size) == \
        (1, 2, 2, 1, 1)
    assert config.cp_backend == "torch" and config.cp_handler.cp_comm_strategy == "alltoall"
    assert config._get_mesh() == (("dp_shard", "cp"), (2, 2))  # TP-style neighbours: one cp group = 2 ranks
    assert config.fsdp_dim_names == ["dp_shard_cp"]  # FSDP2 shards over dp_shard x cp
    assert config.non_dp_dim_names == ["cp"]  # the data loader gives a cp group one batch
    hsdp = context_parallel.accelerate_config(Layout(dp_replicate=2, dp_shard=2, cp=2))
    assert hsdp.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"] and hsdp.cp_handler.cp_comm_strategy == "allgather"
    assert context_parallel.accelerate_config(Layout(dp_shard=4)) is None


def test_the_loss_rule_counts_a_cp_group_once_and_scales_by_dp_x_cp():
    assert CP2.loader_copies == 2 and CP2.whole_batch_copies == 1  # counts before sharding, losses after
    assert context_parallel.loss_multiplier(CP2, CP2.data_parallel_size) == 4  # the Trainer's num_processes // tp
    assert context_parallel.loss_multiplier(Layout(), 8) == 8
    assert Layout(tp=2, dp_shard=2).loader_copies == 2 and Layout(sp=2).loader_copies == 1


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR)


def _rows() -> list[dict]:
    return [{"input_ids": list(range(5, 5 + n)), "attention_mask": [1] * n,
             "labels": [-100] * 2 + list(range(7, 5 + n))} for n in (9, 4)]


def test_the_collator_pads_right_to_a_multiple_of_2_cp_with_positions_and_shifted_labels(tokenizer):
    inner = make_collator(tokenizer, packing=False)
    plain = inner(_rows())
    batch = context_parallel.collator(inner, Layout(cp=4), tokenizer)(_rows())
    assert plain["input_ids"].shape == (2, 9) and batch["input_ids"].shape == (2, 16)  # 2 x cp = 8 divides 16
    assert torch.equal(batch["input_ids"][:, :9], plain["input_ids"])
    assert (batch["input_ids"][:, 9:] == tokenizer.pad_token_id).all() and not batch["attention_mask"][:, 9:].any()
    assert (batch["labels"][:, 9:] == -100).all()
    assert torch.equal(batch["position_ids"], torch.arange(16).expand(2, 16))
    assert torch.equal(batch["shift_labels"][:, :-1], batch["labels"][:, 1:])
    assert (batch["shift_labels"][:, -1] == -100).all()
    assert count_target_tokens(batch) == count_target_tokens(plain) == int((batch["shift_labels"] != -100).sum())


def test_the_model_computes_the_same_loss_from_shift_labels(tokenizer):
    """Under CP the model gets the pre-shifted targets (a chunk's last token predicts the next chunk's first): on the
    whole sequence its loss is the plain batch's."""
    model = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL_DIR, attn_implementation="sdpa")
    inner = make_collator(tokenizer, packing=False)
    plain, batch = inner(_rows()), context_parallel.collator(inner, CP2, tokenizer)(_rows())
    with torch.no_grad():
        want = model(**plain, num_items_in_batch=torch.tensor(count_target_tokens(plain))).loss
        got = model(**model_inputs(batch), num_items_in_batch=torch.tensor(count_target_tokens(batch))).loss
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_left_padding_is_refused_in_one_line(tokenizer):
    from hf_scale.errors import UserError

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL_DIR, padding_side="left")
    with pytest.raises(UserError, match=r"parallelism.cp=2: the tokenizer pads on the left; .* must be on the right"):
        context_parallel.collator(make_collator(tokenizer, packing=False), CP2, tokenizer)


def test_without_a_gpu_cp_is_refused_with_torchs_reason_and_with_one_it_runs():
    refusal = train_refusal(CP2, "parallelism", gpu_present=False)
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in refusal and "run it on GPUs, or set cp to 1" in refusal
    assert train_refusal(CP2, "parallelism", gpu_present=True) is None


def test_the_runtime_guard_refuses_an_accelerator_without_the_cp_size():
    expected = guard.Expected(strategy="fsdp", world_size=4, micro_batch_size=1, gradient_accumulation_steps=1,
                              precision="bf16", cp=2)
    observed = guard.Observed(world_size=4, distributed_type="FSDP", num_processes=4, wrapper="fsdp2",
                              micro_batch_size=1, mixed_precision="bf16", cp=1)
    assert guard.find_problems(expected, observed) == [
        "context parallelism of 2 was requested but accelerate runs cp_size 1: its prepare would not apply the ring "
        "attention"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", [2, 4], ids=["cp2", "dp_shard2_x_cp2"])
def test_accelerate_shards_each_cp_groups_batch_and_the_loss_rule_gives_one_process_gradients(nproc, tmp_path):
    output = tmp_path / "cp.json"
    result = run(torchrun(WORKER, EMBEDDED_MODEL_DIR, output, nproc=nproc), timeout=300, env=child_env())
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(output.read_text())
    data_ranks = nproc // 2
    assert seen["same_batches_in_a_cp_group"] == [True] * data_ranks  # accelerate's split: process_index // cp
    assert seen["data_parallel_batches"] == 8 // 2  # 8 rows in batches of 2, each data-parallel rank its own
    for shard in seen["shards"]:
        length = shard["length"]
        assert length % 4 == 0 and shard["same_rows"]  # every buffer sharded like position_ids
        chunk = length // 4  # load balancing: rank 0 holds chunks 0 and 3 of 2 x cp
        assert shard["positions"] == list(range(chunk)) + list(range(3 * chunk, length))
    assert seen["global_targets"] == seen["one_process_targets"]
    assert seen["step_loss"] == pytest.approx(seen["one_process_loss"], rel=1e-6)
    assert seen["max_relative_grad_error"] < 1e-5
    # The ring attention itself on CPU: torch's error is the reason train.py refuses cp without a GPU. When torch
    # learns to shard the CPU kernel this fails, and the refusal should go.
    kernel = "aten._scaled_dot_product_flash_attention_for_cpu"
    assert kernel in seen["ring_attention_error"] and "sharding strategy" in seen["ring_attention_error"]
    assert kernel in train_refusal(CP2, "x", gpu_present=False)
