"""The one table of values shared by config, flags, accelerate YAML and DeepSpeed JSON."""

from __future__ import annotations

from hf_scale.contract import config_flags, launch_values, shared_values
from hf_scale.knowledge import rules


def test_the_derived_views_are_the_tables_they_replace():
    assert shared_values.FLAG_KEYS == launch_values.FLAG_KEYS
    assert set(shared_values.FIXED_BY_HF_SCALE_CONFIG) == set(config_flags.FIXED_BY_HF_SCALE_CONFIG)
    assert len(shared_values.FIXED_BY_HF_SCALE_CONFIG) == len(config_flags.FIXED_BY_HF_SCALE_CONFIG)
    assert shared_values.ACCELERATE_YAML_TO_DEEPSPEED == rules.ACCELERATE_YAML_TO_DEEPSPEED
    assert list(shared_values.ACCELERATE_YAML_TO_DEEPSPEED) == list(rules.ACCELERATE_YAML_TO_DEEPSPEED)
    assert shared_values.TRAINER_FILLED == rules.TRAINER_FILLED
    assert shared_values.TRAINER_FILLED_ZERO3_ONLY == rules.TRAINER_FILLED_ZERO3_ONLY
    assert [(flag, field) for flag, field, _ in shared_values.CONFIG_FILLS] == [
        ("per_device_train_batch_size", "batch.micro_batch_size"),
        ("gradient_accumulation_steps", "batch.gradient_accumulation_steps"),
        ("max_grad_norm", "gradient_clipping"),
        ("learning_rate", "optimizer.lr"),
        ("adam_beta1", "optimizer.betas[0]"),
        ("adam_beta2", "optimizer.betas[1]"),
        ("adam_epsilon", "optimizer.eps"),
        ("weight_decay", "optimizer.weight_decay"),
    ]  # the tuple fill_flags_from_config iterated
