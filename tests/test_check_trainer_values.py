"""`hf-scale check`, what the HF Trainer compares at launch (hf_scale.check.trainer_values)."""

from __future__ import annotations

import pytest
from check_cases import (
    DS_JSON,
    DS_YAML,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    merged,
)

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "scheduler-block-replaces-explicit-flag": (
        DS_YAML,
        merged(DS_JSON, {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}),
        ["--lr_scheduler_type", "cosine"],
        None,
        [],
        "ds-overrides-flags",
        "error",
    ),
    "scheduler-block-replaces-default": (
        DS_YAML,
        merged(DS_JSON, {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}}),
        [],
        None,
        [],
        "ds-overrides-flags",
        "warning",
    ),
    "concrete-betas-vs-default-flags": (
        DS_YAML,
        merged(DS_JSON, {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}}}),
        ["--bf16"],
        None,
        [],
        "ds-trainer-mismatch",
        "error",
    ),
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)



@pytest.mark.parametrize(
    ("block", "train", "expected"),
    [
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, [], []),
        ({"optimizer": {"type": "Lamb", "params": {"lr": "auto"}}}, [], [("ds-overrides-flags", "warning")]),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, ["--optim", "adafactor"],
         [("ds-overrides-flags", "error")]),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}, [],
         [("ds-overrides-flags", "warning")]),
    ],
)
def test_optimizer_and_scheduler_blocks_name_the_flags_they_replace(block, train, expected, tmp_path, monkeypatch,
                                                                   capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(DS_JSON, block), [*train, "--bf16"])
    found = [(f["code"], f["severity"]) for f in payload["findings"]]
    assert found == expected
    for finding in payload["findings"]:
        assert "--optim" in finding["problem"] or "--lr_scheduler_type" in finding["problem"]


def test_warmup_scheduler_says_its_warmup_is_logarithmic(tmp_path, monkeypatch, capsys):
    block = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(DS_JSON, block), ["--bf16"])
    assert "logarithmic" in payload["findings"][0]["problem"]
    block["scheduler"]["params"]["warmup_type"] = "linear"
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(DS_JSON, block), ["--bf16"])
    assert "logarithmic" not in payload["findings"][0]["problem"]
