"""hf_scale.contract.launch_values: the launcher's config (accelerate YAML precision, DeepSpeed JSON) against the flags.

Pure-function tests, plus the proof that the rule is transformers' own: where it finds no mismatch (after
following), HfTrainerDeepSpeedConfig accepts the same JSON and flags; where it finds one, transformers raises.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_scale.contract.launch_values import TrainingValues, planned_optimizer_steps, reconcile

REPO = Path(__file__).resolve().parents[2]
SRC = "ds.json"
MODEL = SimpleNamespace(config=SimpleNamespace(hidden_size=64))  # what finalize reads for the "auto" buckets


def preset_json(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / f"{name}.json").read_text())


def run(ds=None, given=(), accelerate=None, steps=None, **values):
    return reconcile(TrainingValues(world_size=values.pop("world_size", 2), **values), given, deepspeed_config=ds,
                     deepspeed_source=SRC, accelerate_mixed_precision=accelerate, num_training_steps=steps)


def test_a_bf16_preset_without_flags_runs_in_bf16():
    result = run(preset_json("zero3"))
    assert result.mismatches == []
    assert result.values.bf16 and not result.values.fp16
    assert result.followed == {"bf16": "ds.json bf16.enabled=true and ds.json fp16.enabled=false"}


def test_deepspeeds_older_bfloat16_block_counts_as_bf16():
    """DeepSpeed still reads `"bfloat16": {"enabled": true}` (its BFLOAT16_OLD): followed as bf16, by doctor too
    (hf_scale.knowledge.rules.DEEPSPEED_PRECISION_BLOCKS)."""
    from hf_scale.doctor.config_verdict import _deepspeed_precision

    ds = {"bfloat16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    result = run(ds)
    assert result.mismatches == [] and result.values.bf16 and not result.values.fp16
    assert result.followed == {"bf16": "ds.json bfloat16.enabled=true"}
    assert _deepspeed_precision(ds, None) == "bf16"


def test_an_explicit_conflicting_precision_flag_is_one_mismatch():
    result = run(preset_json("zero2"), given={"fp16"}, fp16=True)
    assert result.mismatches == [
        "--fp16 conflicts with ds.json bf16.enabled=true and ds.json fp16.enabled=false; drop the flag (the "
        "precision follows the launcher's config) or change the config"
    ]
    assert run(preset_json("zero2"), given={"bf16"}, bf16=True).mismatches == []
    # --bf16 false is explicit too: the user asked for fp32.
    assert run(preset_json("zero2"), given={"bf16"}).mismatches[0].startswith("--bf16 false / --fp16 false conflicts")


@pytest.mark.parametrize(
    ("accelerate", "given", "flags", "want", "problem"),
    [
        ("bf16", (), {}, "bf16", None),
        ("fp16", (), {}, "fp16", None),
        ("no", (), {}, "no", None),  # what accelerate writes when the YAML says nothing: fixes nothing
        ("no", ("bf16",), {"bf16": True}, "bf16", None),
        ("bf16", ("fp16",), {"fp16": True}, None, "--fp16 conflicts with the accelerate config's mixed_precision=bf16"),
        ("fp8", (), {}, "bf16", None),  # fp8 matmuls under bf16 autocast: --bf16
        ("fp8", ("fp16",), {"fp16": True}, None, "--fp16 conflicts with the accelerate config's mixed_precision=fp8"),
        ("fp4", (), {}, None, "mixed_precision=fp4 is not supported by train.py"),
    ],
)
def test_accelerate_mixed_precision_is_followed_or_conflicts(accelerate, given, flags, want, problem):
    result = run(accelerate=accelerate, given=given, **flags)
    if problem:
        assert len(result.mismatches) == 1 and problem in result.mismatches[0]
    else:
        assert result.mismatches == [] and result.values.precision == want


def test_accelerate_and_deepspeed_precisions_that_disagree():
    result = run(preset_json("zero3"), accelerate="fp16")
    assert result.mismatches == [
        "ds.json bf16.enabled=true and ds.json fp16.enabled=false and the accelerate config's mixed_precision=fp16 "
        "disagree about the precision"
    ]


def test_auto_values_follow_the_flags_and_never_conflict():
    result = run(preset_json("zero2_offload"), given={"per_device_train_batch_size", "learning_rate", "bf16"},
                 per_device_train_batch_size=3, learning_rate=1e-3, bf16=True, adam_beta1=0.8)
    assert result.mismatches == [] and result.followed == {}


def test_concrete_batch_values_are_followed_or_conflict():
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 16}
    followed = run(ds)
    assert followed.mismatches == []
    assert (followed.values.per_device_train_batch_size, followed.values.gradient_accumulation_steps) == (4, 2)
    conflict = run(ds, given={"per_device_train_batch_size"}, per_device_train_batch_size=2)
    assert conflict.mismatches == [
        "ds.json train_micro_batch_size_per_gpu=4 but --per_device_train_batch_size=2",
        "ds.json train_batch_size=16 but micro batch 2 x accumulation 2 x world size 2 = 8",
    ]


def test_train_batch_size_alone_sets_the_accumulation_unless_a_flag_does():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    result = run(ds, given={"per_device_train_batch_size"}, per_device_train_batch_size=2)
    assert result.mismatches == [] and result.values.gradient_accumulation_steps == 8
    result = run(ds, given={"gradient_accumulation_steps"}, per_device_train_batch_size=2,
                 gradient_accumulation_steps=2)
    assert result.mismatches == ["ds.json train_batch_size=32 but micro batch 2 x accumulation 2 x world size 2 = 8"]


def test_optimizer_and_clipping_values():
    params = {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}
    ds = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": params}}
    result = run(ds)
    assert result.mismatches == []
    v = result.values
    assert (v.max_grad_norm, v.learning_rate, v.adam_beta1, v.adam_beta2, v.adam_epsilon, v.weight_decay) == (
        0.0, 1e-4, 0.9, 0.95, 1e-6, 0.1)
    result = run(ds, given={"adam_beta2", "learning_rate"}, adam_beta2=0.999, learning_rate=1e-4)
    assert result.mismatches == ["ds.json optimizer.params.betas=[0.9, 0.95] but --adam_beta1+--adam_beta2=0.9+0.999"]


def test_two_json_values_that_disagree_are_a_mismatch_even_without_flags():
    ds = {"optimizer": {"params": {"lr": 1e-4}}, "scheduler": {"params": {"warmup_max_lr": 3e-4}}}
    assert run(ds).mismatches == ["ds.json scheduler.params.warmup_max_lr=0.0003 but --learning_rate=0.0001"]


def test_invalid_json_values_are_not_followed():
    assert run({"train_micro_batch_size_per_gpu": 0}).mismatches == [
        "ds.json train_micro_batch_size_per_gpu=0 is not a valid value for --per_device_train_batch_size"
    ]


def test_scheduler_steps():
    ds = {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}}
    result = run(ds)
    assert result.mismatches == [] and (result.values.max_steps, result.values.warmup_steps) == (100, 10)
    result = run(ds, given={"max_steps", "warmup_steps"}, max_steps=50, warmup_steps=5, steps=50)
    assert result.mismatches == [
        "ds.json scheduler.params.total_num_steps=100 but the run takes 50 optimizer steps (--max_steps / "
        "--num_train_epochs)",
        "ds.json scheduler.params.warmup_num_steps=10 but --warmup_steps gives 5",
    ]
    # A warmup fraction needs the run's length: unknown yet, nothing is compared.
    assert run({"scheduler": {"params": {"warmup_num_steps": 10}}}, warmup_steps=0.1).mismatches == []


def test_planned_optimizer_steps_counts_like_the_trainer():
    values = TrainingValues(world_size=2, per_device_train_batch_size=2, gradient_accumulation_steps=3)
    # 50 examples -> 13 micro-batches per rank -> 5 optimizer steps per epoch (the last one partial).
    assert planned_optimizer_steps(50, values, 2) == 10
    assert planned_optimizer_steps(50, values, 0.5) == 3


# --- the same verdicts as transformers ---------------------------------------------------------------------

CASES = {
    "bf16-preset-no-flags": (preset_json("zero3"), {}, set()),
    "bf16-preset-fp16-flag": (preset_json("zero3"), {"fp16": True}, {"fp16"}),
    "micro-followed": ({"train_micro_batch_size_per_gpu": 4, "train_batch_size": "auto"}, {}, set()),
    "micro-conflict": ({"train_micro_batch_size_per_gpu": 4}, {"per_device_train_batch_size": 2},
                       {"per_device_train_batch_size"}),
    "lr-followed": ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.8, 0.9]}}}, {}, set()),
    "eps-conflict": ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}, {"adam_epsilon": 1e-8},
                     {"adam_epsilon"}),
    "clipping-conflict": ({"gradient_clipping": 0.5}, {"max_grad_norm": 1.0}, {"max_grad_norm"}),
    "scheduler-followed": ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7,
                                                                          "total_num_steps": 20}}}, {}, set()),
}


@pytest.mark.parametrize(("ds", "flags", "given"), CASES.values(), ids=CASES.keys())
def test_transformers_agrees_with_the_rule(ds, flags, given, tmp_path, monkeypatch):
    from accelerate.state import AcceleratorState
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    base = TrainingValues(world_size=1, **flags)
    result = reconcile(base, given, deepspeed_config=ds, num_training_steps=None)
    v = result.values
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], bf16=v.bf16, fp16=False if v.bf16 else v.fp16,
        per_device_train_batch_size=v.per_device_train_batch_size,
        gradient_accumulation_steps=v.gradient_accumulation_steps, max_grad_norm=v.max_grad_norm,
        learning_rate=v.learning_rate, adam_beta1=v.adam_beta1, adam_beta2=v.adam_beta2,
        adam_epsilon=v.adam_epsilon, weight_decay=v.weight_decay, max_steps=v.max_steps, warmup_steps=v.warmup_steps,
    )
    if v.fp16 and not v.bf16:
        args.fp16 = True  # TrainingArguments refuses fp16 on CPU; the comparison only reads the attribute
    try:
        hf = HfTrainerDeepSpeedConfig(json.loads(json.dumps(ds)))
        hf.trainer_config_process(args)
        steps = v.max_steps if v.max_steps > 0 else 10
        if result.mismatches:
            with pytest.raises(ValueError, match="mismatch TrainingArguments"):
                hf.trainer_config_finalize(args, MODEL, num_training_steps=steps)
        else:
            hf.trainer_config_finalize(args, MODEL, num_training_steps=steps)
    finally:
        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)


def test_a_missing_accumulation_is_1_as_accelerate_writes_it():
    """train.py's rule: no gradient_accumulation_steps in the DeepSpeed config is accelerate's 1 (not "auto"), so a
    typed --gradient_accumulation_steps 8 is a one-line mismatch (DeepSpeed would assert, or accumulate nothing), and
    a concrete train_batch_size no longer derives the accumulation."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "zero_optimization": {"stage": 2}}
    result = run(ds, given={"gradient_accumulation_steps"}, gradient_accumulation_steps=8)
    assert result.mismatches == ["ds.json has no gradient_accumulation_steps, which accelerate's DeepSpeedPlugin sets "
                                 'to 1, but --gradient_accumulation_steps=8; add "gradient_accumulation_steps": '
                                 '"auto" to it (then it follows the flag)']
    assert run(ds, given=set()).mismatches == []
    result = run({**ds, "train_batch_size": 32}, given={"per_device_train_batch_size"}, per_device_train_batch_size=2)
    assert result.mismatches == ["ds.json train_batch_size=32 but micro batch 2 x accumulation 1 x world size 2 = 4"]


def test_a_default_warmup_is_said_as_0_compared_as_1():
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1000}}, "gradient_accumulation_steps": 1}
    result = run(ds, given={"warmup_steps"})
    assert result.mismatches == ["ds.json scheduler.params.warmup_num_steps=1000 but --warmup_steps gives 0 (compared "
                                 "as 1)"]
    assert result.differences[0].flag_value == 0
