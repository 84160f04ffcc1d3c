"""guard.find_problems, the pure comparison behind the runtime guard: every problem it can name, and none for
a run that is what was asked for. In-process and fast (tests/train/setup/test_guard.py builds each fallback for
real in 2 processes)."""

from __future__ import annotations

import dataclasses

import pytest

from hf_scale.train.setup import guard
from hf_scale.train.setup.guard import Expected, Observed, find_problems

ENGINE = {"zero_stage": 3, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "train_batch_size": 16,
          "precision": "bf16"}
HEALTHY = {
    "ddp": (Expected("ddp", 2, 2, 4, "bf16"),
            Observed(2, "MULTI_GPU", 2, "ddp", micro_batch_size=2, mixed_precision="bf16")),
    "deepspeed": (Expected("deepspeed", 2, 2, 4, "bf16", zero_stage=3, zero3_init=True),
                  Observed(2, "DEEPSPEED", 2, "deepspeed", micro_batch_size=2, mixed_precision="bf16",
                           deepspeed=ENGINE, zero3_partitioned=True)),
    "fsdp": (Expected("fsdp", 2, 2, 4, "bf16", fsdp_version=2),
             Observed(2, "FSDP", 2, "fsdp2", micro_batch_size=2, mixed_precision="bf16")),
    "fsdp1": (Expected("fsdp", 2, 2, 4, "bf16", fsdp_version=1),
              Observed(2, "FSDP", 2, "fsdp1", micro_batch_size=2, mixed_precision="bf16")),
    "single": (Expected("single", 1, 2, 4, "no"), Observed(1, "NO", 1, "none", micro_batch_size=2,
                                                            mixed_precision="no")),
}


@pytest.mark.parametrize("strategy", sorted(HEALTHY))
def test_a_run_that_is_what_was_asked_for_has_no_problem(strategy):
    assert find_problems(*HEALTHY[strategy]) == []
    guard.verify_runtime(*HEALTHY[strategy])


def _observed(strategy: str, **changes) -> tuple[Expected, Observed]:
    expected, observed = HEALTHY[strategy]
    return expected, dataclasses.replace(observed, **changes)


CASES = {
    "single-process-cpu-launch": (_observed("ddp", single_process_cpu_launch=True), "accelerate started ONE process"),
    "world-size": (_observed("ddp", world_size=1, num_processes=1), "WORLD_SIZE=2 processes but the live process"),
    "no-distributed-state": (_observed("ddp", distributed_type="NO"), "DistributedType.NO"),
    "deepspeed-not-running": (_observed("deepspeed", distributed_type="MULTI_GPU", wrapper="ddp", deepspeed=None),
                              "DeepSpeed was requested but accelerate runs MULTI_GPU"),
    "fsdp-not-sharded": (_observed("fsdp", wrapper="ddp"), "FSDP was requested but the model is not sharded"),
    # --hf_scale_config's fsdp.version 1 once ran FSDP2 (hf_scale.train.model.fsdp hard-coded it), and back
    "fsdp1-run-as-fsdp2": (_observed("fsdp1", wrapper="fsdp2"), "FSDP version 1 was requested but the model is "
                                                                 "wrapped by FSDP2"),
    "fsdp2-run-as-fsdp1": (_observed("fsdp", wrapper="fsdp1"), "FSDP version 2 was requested but the model is "
                                                                "wrapped by FSDP1"),
    "ddp-not-wrapped": (_observed("ddp", wrapper="none"), "DDP over 2 processes was requested"),
    "zero-stage": (_observed("deepspeed", deepspeed={**ENGINE, "zero_stage": 2}),
                   "ZeRO stage 3 was requested but the engine runs stage 2"),
    "engine-micro-batch": (_observed("deepspeed", deepspeed={**ENGINE, "micro_batch_size": 1}),
                           "DeepSpeed train_micro_batch_size_per_gpu=1 but --per_device_train_batch_size=2"),
    "engine-accumulation": (_observed("deepspeed", deepspeed={**ENGINE, "gradient_accumulation_steps": 1}),
                            "DeepSpeed gradient_accumulation_steps=1 but --gradient_accumulation_steps=4"),
    "engine-global-batch": (_observed("deepspeed", deepspeed={**ENGINE, "train_batch_size": 32}),
                            "train_batch_size=32 but micro 2 x accumulation 4 x data-parallel ranks 2 = 16"),
    "engine-precision": (_observed("deepspeed", deepspeed={**ENGINE, "precision": "no"}),
                         "DeepSpeed runs precision no but the flags ask for bf16"),
    "zero3-built-full": (_observed("deepspeed", zero3_partitioned=False), "the model was built unpartitioned"),
    "loader-micro-batch": (_observed("ddp", micro_batch_size=8),
                           "micro-batches of 8 but --per_device_train_batch_size=2"),
    "accelerate-precision": (_observed("ddp", mixed_precision="no"),
                             "accelerate runs mixed_precision=no but the flags ask for bf16"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_silent_fallback_is_one_named_problem(case):
    (expected, observed), fragment = CASES[case]
    problems = find_problems(expected, observed)
    assert len(problems) == 1 and fragment in problems[0], problems
    with pytest.raises(guard.RuntimeGuardError, match="^runtime guard: "):
        guard.verify_runtime(expected, observed)


def test_every_problem_is_named_in_one_line():
    expected, _ = HEALTHY["deepspeed"]
    observed = dataclasses.replace(HEALTHY["deepspeed"][1], deepspeed={**ENGINE, "zero_stage": 1, "precision": "fp16"},
                                   zero3_partitioned=False)
    problems = find_problems(expected, observed)
    assert len(problems) == 3
    with pytest.raises(guard.RuntimeGuardError) as raised:
        guard.verify_runtime(expected, observed)
    assert "\n" not in str(raised.value) and all(problem in str(raised.value) for problem in problems)


@pytest.mark.parametrize(("bf16", "fp16", "precision"), [(True, False, "bf16"), (False, True, "fp16"),
                                                         (False, False, "no")])
def test_expected_precision_is_the_rule(bf16, fp16, precision):
    assert guard.expected_precision(bf16, fp16) == precision


def test_tensor_parallel_run_needs_a_model_built_with_that_tp_size():
    """tp = world under strategy ddp: no DDP wrapper is right (one TP group); a model not built on the mesh is not."""
    expected = Expected("ddp", 2, 4, 2, "no", tp=2)
    built = Observed(2, "MULTI_CPU", 2, "none", micro_batch_size=4, mixed_precision="no", tp=2)
    assert find_problems(expected, built) == []
    not_built = Observed(2, "MULTI_CPU", 2, "none", micro_batch_size=4, mixed_precision="no")
    assert find_problems(expected, not_built) == [
        "tensor parallelism of 2 was requested but the model is built with tp_size 1"]


def test_expert_parallel_run_needs_a_model_whose_experts_are_split_that_many_ways():
    """The measure is the model itself: the config's routed experts over what an experts module holds after
    transformers' EP plan (a real Qwen3-MoE module, its num_experts set to the local count as GroupedGemmParallel
    does)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hf_scale.train.setup.guard import expert_split

    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=16, num_experts=4, num_experts_per_tok=2, vocab_size=64))
    assert expert_split(model) == 1  # not split
    experts = next(m for name, m in model.named_modules() if name.endswith("mlp.experts"))
    experts.num_experts, experts._is_expert_parallel = 2, True
    assert expert_split(model) == 2
    expected = Expected("fsdp", 2, 4, 2, "no", ep=2)
    not_split = Observed(2, "MULTI_CPU", 2, "fsdp2", micro_batch_size=4, mixed_precision="no")
    assert find_problems(expected, not_split) == [
        "expert parallelism of 2 was requested but the model's routed experts are split 1 way(s)"]
    assert find_problems(expected, Observed(2, "MULTI_CPU", 2, "fsdp2", micro_batch_size=4, mixed_precision="no",
                                            ep=2)) == []
