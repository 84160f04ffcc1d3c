"""`hf-scale check`, ZeRO offload and saving (hf_scale.check.zero)."""

from __future__ import annotations

import pytest
from check_cases import (
    DS_JSON,
    DS_YAML,
    YAML_ONLY_DS,
    ZERO3_JSON,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
)

from hf_scale.check import zero

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "offload-without-ds-optimizer-trainer": (
        DS_YAML,
        merged(ZERO3_JSON, {"optimizer": None}),
        [],
        None,
        [],
        "offload-optimizer-swap",
        "warning",
    ),
    "offload-without-ds-optimizer-raw": (
        DS_YAML,
        {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        },
        [],
        "deepspeed",
        [],
        "offload-optimizer-swap",
        "error",
    ),
    "offload-yaml-only": (
        merged(YAML_ONLY_DS, {"deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "cpu"}}),
        None,
        ["--gradient_accumulation_steps", "2"],
        None,
        [],
        "offload-optimizer-swap",
        "warning",
    ),
    "nvme-json": (
        DS_YAML,
        merged(ZERO3_JSON, {"zero_optimization": {"offload_param": {"device": "nvme"}}}),
        [],
        None,
        [],
        "nvme-without-path",
        "error",
    ),
    "nvme-yaml": (
        merged(YAML_ONLY_DS, {"deepspeed_config": {"offload_param_device": "nvme"}}),
        None,
        [],
        None,
        [],
        "nvme-without-path",
        "error",
    ),
    "zero3-without-16bit-save": (
        DS_YAML,
        merged(ZERO3_JSON, {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": None}}),
        [],
        None,
        [],
        "zero3-no-16bit-save",
        "warning",
    ),
    "zero3-yaml-without-16bit-save": (
        merged(YAML_ONLY_DS, {"deepspeed_config": {"zero3_save_16bit_model": False}}),
        None,
        [],
        None,
        [],
        "zero3-no-16bit-save",
        "warning",
    ),
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)



@pytest.mark.parametrize("spelling", zero.GATHER_SPELLINGS)
def test_16bit_gather_is_read_in_every_spelling_deepspeed_reads(spelling, tmp_path, monkeypatch, capsys):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = {"stage": 3, spelling: True}
    assert DeepSpeedZeroConfig(**zero).gather_16bit_weights_on_model_save is True  # DeepSpeed reads it
    ds = merged(DS_JSON, {"zero_optimization": zero})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    assert "zero3-no-16bit-save" not in codes(payload)
    ds = merged(ds, {"zero_optimization": {spelling: False}})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    (finding,) = [f for f in payload["findings"] if f["code"] == "zero3-no-16bit-save"]
    assert finding["key"] == f"zero_optimization.{spelling}"
