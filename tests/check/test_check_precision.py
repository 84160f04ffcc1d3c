"""`hf-scale check`, precision (hf_scale.check.precision)."""

from __future__ import annotations

import pytest
from check_cases import (
    DDP_YAML,
    DS_JSON,
    DS_YAML,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
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
    "precision-json-vs-default-flags": (
        DS_YAML,
        merged(DS_JSON, {"bf16": {"enabled": True}}),
        ["--max_steps", "3"],
        None,
        [],
        "precision-mismatch",
        "warning",  # train.py follows bf16.enabled; a plain HF Trainer script stops
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



def test_a_precision_flag_left_out_is_followed_not_compared(tmp_path, monkeypatch, capsys):
    """train.py (and the HF Trainer, from ACCELERATE_MIXED_PRECISION) run a left-out precision as the accelerate
    YAML says: no finding; typed, the same difference is an error."""
    _, payload = check_json(tmp_path, monkeypatch, capsys, DDP_YAML, None, ["--max_steps", "3"])
    assert "precision-mismatch" not in codes(payload), payload["findings"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, DDP_YAML, None, ["--bf16", "false"])
    (finding,) = [f for f in payload["findings"] if f["code"] == "precision-mismatch"]
    assert finding["severity"] == "error" and "--bf16/--fp16 false='no'" in finding["problem"]


def test_the_warning_names_the_file_key_both_values_and_the_fix(tmp_path, monkeypatch, capsys):
    code, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(DS_JSON, {"fp16": {"enabled": True},
                                                                                        "bf16": None}), ["--seed", "1"])
    assert code == 0
    (finding,) = payload["findings"]
    assert finding["severity"] == "warning" and finding["where"] == "ds.json:fp16.enabled"
    assert finding["values"] == {"ds.json:fp16.enabled": True, "training args:--bf16/--fp16 (not given)": "no"}
    assert "train.py follows the file (fp16)" in finding["problem"]
    assert finding["fix"] == ('Pass --fp16 in the training args (then both agree for any script), or set '
                              '`fp16.enabled` to "auto" in ds.json.')


@pytest.mark.parametrize("flag", ["--bf16", "--fp16"])
@pytest.mark.parametrize("runner", ["trainer", "accelerate"])
def test_mixed_precision_no_fixes_nothing_for_the_trainer(flag, runner, tmp_path, monkeypatch, capsys):
    """`mixed_precision: 'no'` is what accelerate writes when nothing is chosen: the HF Trainer hands --bf16/--fp16 to
    the Accelerator (TrainingArguments.mixed_precision), which wins. A hand-written Accelerator loop runs with 'no'."""
    yaml_cfg = merged(DDP_YAML, {"mixed_precision": "no"})
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, train=[flag], runner=runner)
    assert ("precision-mismatch" in codes(payload)) == (runner == "accelerate")
