"""`hf-scale check`, precision (hf_scale.check.precision)."""

from __future__ import annotations

import pytest
from check_cases import (
    DDP_YAML,
    DS_JSON,
    DS_YAML,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    merged,
)

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "precision-yaml-vs-args": (
        merged(DDP_YAML, {"mixed_precision": "fp16"}),
        None,
        ["--bf16"],
        None,
        [],
        "precision-mismatch",
        "error",
    ),
    "precision-json-vs-args": (
        DS_YAML,
        merged(DS_JSON, {"bf16": {"enabled": True}}),
        ["--fp16"],
        None,
        [],
        "precision-mismatch",
        "error",
    ),
    "precision-json-disabled-vs-args": (
        DS_YAML,
        merged(DS_JSON, {"bf16": {"enabled": False}}),
        ["--bf16"],
        None,
        [],
        "precision-mismatch",
        "error",
    ),
    "precision-yaml-vs-json": (
        merged(DS_YAML, {"deepspeed_config": {"deepspeed_config_file": None}, "mixed_precision": "fp16"}),
        merged(DS_JSON, {"bf16": {"enabled": True}}),
        [],
        None,
        ["--deepspeed-config", "ds.json"],
        "precision-mismatch",
        "error",
    ),
    "fp16-and-bf16-json": (
        DS_YAML,
        merged(DS_JSON, {"fp16": {"enabled": True}, "bf16": {"enabled": True}}),
        [],
        None,
        [],
        "fp16-and-bf16",
        "error",
    ),
    "fp16-and-bf16-args": (DDP_YAML, None, ["--fp16", "--bf16"], None, [], "fp16-and-bf16", "error"),
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)

