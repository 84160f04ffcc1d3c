"""`hf-scale check`, QLoRA (hf_scale.check.qlora): --load_in_4bit in the training args with what train.py refuses
(no LoRA rank, fp8, FSDP version 1); DDP, ZeRO-3 and FSDP2, which it runs, are clean."""

from __future__ import annotations

import pytest
from check_cases import (
    DDP_YAML,
    DS_JSON,
    DS_YAML,
    FSDP_YAML,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
)

FP8_YAML = merged(DDP_YAML, {"mixed_precision": "fp8", "fp8_config": {"backend": "AO"}})
QLORA = ["--load_in_4bit", "--lora_r", "16", "--bf16"]

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "4bit-without-lora": (DDP_YAML, None, ["--load_in_4bit", "--bf16"], None, [], "qlora-no-lora", "error"),
    "4bit-with-fp8": (FP8_YAML, None, [*QLORA, "--torch_compile"], None, [], "qlora-fp8", "error"),
    "4bit-with-fsdp1": (merged(FSDP_YAML, {"fsdp_config": {"fsdp_version": 1}}), None, QLORA, None, [],
                        "qlora-fsdp1", "error"),
    "4bit-with-fsdp-version-unwritten": (merged(FSDP_YAML, {"fsdp_config": {"fsdp_version": None}}), None, QLORA, None,
                                         [], "qlora-fsdp1", "error"),
}


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("yaml_cfg", [DDP_YAML, DS_YAML, FSDP_YAML], ids=["ddp", "deepspeed", "fsdp"])
def test_qlora_under_ddp_deepspeed_and_fsdp_is_clean(yaml_cfg, tmp_path, monkeypatch, capsys):
    ds_json = DS_JSON if yaml_cfg is DS_YAML else None
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds_json, QLORA, None, [])
    assert not [c for c in codes(payload) if c.startswith("qlora-")]
