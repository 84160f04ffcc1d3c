"""The one table of values shared by config, flags, accelerate YAML and DeepSpeed JSON (hf_scale.contract.shared_values)
holds to the libraries and to train.py: its flags are train.py's, its DeepSpeed keys are in DeepSpeed's own config
schema, its config fields are a DistributedConfig's. (The YAML map and the Trainer's fills are proved against
accelerate's and transformers' source in tests/knowledge/test_library_tables.py.)"""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from hf_scale.config.presets import load_preset
from hf_scale.contract import launch_values, shared_values
from hf_scale.contract.parser import build_parser

ROWS = shared_values.SHARED_VALUES


def _zero_model_has(model, parts: list[str]) -> bool:
    """Whether DeepSpeed's pydantic ZeRO config (``extra="forbid"``) takes the nested key ``parts`` (name or alias)."""
    for index, part in enumerate(parts):
        field = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if field is None:
            return False
        if index < len(parts) - 1:
            models = [t for t in typing.get_args(field.annotation) or (field.annotation,) if hasattr(t, "model_fields")]
            if not models:
                return False
            model = models[0]
    return True


def in_deepspeed_schema(path: str) -> bool:
    """Whether DeepSpeed's own config code reads the JSON path: its top-level constants, its ZeRO and precision
    pydantic models, the params of the optimizer (torch's AdamW, what DeepSpeed builds for "AdamW") and of its
    WarmupDecayLR scheduler."""
    import deepspeed.runtime.constants as constants
    from deepspeed.runtime.lr_schedules import WarmupDecayLR
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from torch.optim import AdamW

    head, *rest = path.split(".")
    if head == "zero_optimization":
        return _zero_model_has(DeepSpeedZeroConfig, rest)
    if head in ("bf16", "fp16"):
        return rest[0] in {"bf16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config}[head].model_fields
    if head in ("optimizer", "scheduler"):
        takes = AdamW if head == "optimizer" else WarmupDecayLR
        return rest[0] == "params" and rest[1] in inspect.signature(takes).parameters
    return not rest and head in {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)}


def test_every_deepspeed_key_is_in_deepspeeds_config_schema_once():
    keys = [row.deepspeed_key for row in ROWS]
    assert [key for key in keys if not in_deepspeed_schema(key)] == []
    assert len(keys) == len(set(keys)), "one row per value"


def test_the_schema_check_sees_a_key_deepspeed_does_not_read():
    assert in_deepspeed_schema("zero_optimization.offload_param.device")
    assert not in_deepspeed_schema("zero_optimization.offload_param.devices")
    assert not in_deepspeed_schema("optimizer.params.momentum")
    assert not in_deepspeed_schema("train_micro_batch_size")


def test_every_flag_is_a_train_py_flag_and_every_compared_one_is_read_by_the_comparison():
    flags = {action.dest for action in build_parser()._actions}
    assert {flag for row in ROWS for flag in row.flags} - flags == set()
    compared = {flag for row in ROWS if row.fill_match for flag in row.flags}
    assert compared - {field.name for field in dataclasses.fields(launch_values.TrainingValues)} == set()


@pytest.mark.parametrize("preset", ["ddp", "zero3_offload"])
def test_every_config_field_is_a_distributed_configs_and_fills_a_flag_it_fixes(preset):
    cfg = load_preset(preset)
    for row in ROWS:
        assert len(row.config_fields) in (0, len(row.flags)), row
        for field in row.config_fields:
            assert shared_values.config_value(cfg, field) is not None or row.config_unset is not None, field
    filled = {flag for flag, _, _ in shared_values.CONFIG_FILLS}
    assert filled <= set(shared_values.FIXED_BY_HF_SCALE_CONFIG)
    assert shared_values.config_value(cfg, "optimizer.betas[1]") == cfg.optimizer.betas[1]


def test_the_views_are_the_rows():
    assert shared_values.FLAG_KEYS[4] == ("optimizer.params.betas", ("adam_beta1", "adam_beta2"))
    assert shared_values.ACCELERATE_YAML_TO_DEEPSPEED["zero_stage"] == "zero_optimization.stage"
    assert set(shared_values.ACCELERATE_YAML_TO_DEEPSPEED.values()) <= shared_values.TRAINER_FILLED
    assert not shared_values.TRAINER_FILLED & shared_values.TRAINER_FILLED_ZERO3_ONLY
    assert "bf16" in shared_values.FIXED_BY_HF_SCALE_CONFIG and "bf16" not in dict(shared_values.FLAG_KEYS).values()
