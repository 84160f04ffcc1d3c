"""`hf-scale check`, the batch checks (hf_scale.check.batch): accumulation, micro batch, DeepSpeed's arithmetic."""

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

from hf_scale.check import batch as batch_checks

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "grad-accum-json-vs-args": (
        DS_YAML,
        merged(DS_JSON, {"gradient_accumulation_steps": 4}),
        ["--gradient_accumulation_steps", "2"],
        None,
        [],
        "grad-accum-mismatch",
        "error",
    ),
    "grad-accum-yaml-vs-json": (
        merged(
            DS_YAML, {"deepspeed_config": {"deepspeed_config_file": None, "gradient_accumulation_steps": 2}}
        ),
        merged(DS_JSON, {"gradient_accumulation_steps": 4}),
        ["--deepspeed", "ds.json", "--gradient_accumulation_steps", "2"],
        None,
        [],
        "grad-accum-mismatch",
        "error",
    ),
    "train-batch-arithmetic": (
        DS_YAML,
        merged(
            DS_JSON,
            {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
        ),
        [],
        None,
        [],
        "train-batch-mismatch",
        "error",
    ),
    "train-batch-from-training-args": (
        merged(DS_YAML, {"num_processes": 4}),
        merged(DS_JSON, {"train_batch_size": 32}),
        ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"],
        None,
        [],
        "train-batch-mismatch",
        "error",
    ),
    "train-batch-not-divisible": (
        DS_YAML,
        merged(DS_JSON, {"train_batch_size": 15, "gradient_accumulation_steps": 2}),
        [],
        None,
        [],
        "train-batch-invalid",
        "error",
    ),
    "train-batch-below-world-size": (
        merged(DS_YAML, {"num_processes": 8}),
        {"train_batch_size": 4, "zero_optimization": {"stage": 2}},
        [],
        None,
        [],
        "train-batch-invalid",
        "error",
    ),
    "no-batch-size-at-all": (
        DS_YAML,
        {"zero_optimization": {"stage": 2}},
        [],
        None,
        [],
        "train-batch-invalid",
        "error",
    ),
    "micro-batch": (
        DS_YAML,
        merged(DS_JSON, {"train_micro_batch_size_per_gpu": 4}),
        ["--per_device_train_batch_size", "8"],
        None,
        [],
        "micro-batch-mismatch",
        "error",
    ),
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)



def test_train_batch_finding_shows_the_arithmetic(tmp_path, monkeypatch, capsys):
    ds = merged(
        DS_JSON,
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
    )
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(DS_YAML, {"num_processes": 3}), ds)
    (finding,) = [f for f in payload["findings"] if f["code"] == "train-batch-mismatch"]
    assert "4 x 1 x 3 = 12" in finding["problem"]
    assert "12" in finding["fix"]


@pytest.mark.parametrize(
    ("total", "micro", "accum", "world"),
    [(4, None, None, 8), (16, None, 1, 32), (65536, 64, None, 48), (8, 2, 2, 2), (12, None, 2, 2), (None, None, 2, 2)],
)
def test_batch_findings_agree_with_deepspeeds_own_arithmetic(total, micro, accum, world, tmp_path, monkeypatch,
                                                            capsys):
    ds = {"zero_optimization": {"stage": 2}}
    for key, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", accum)):
        if value is not None:
            ds[key] = value
    accepted, _, _ = batch_checks.deepspeed_accepts_batch(total, micro, accum, world)
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(DS_YAML, {"num_processes": world}), ds,
                            runner="deepspeed")
    batch = [f for f in payload["findings"] if f["code"].startswith("train-batch")]
    assert bool(batch) != accepted, batch


@pytest.mark.parametrize(("flag", "runner", "expected"), [
    (["--gradient_accumulation_steps", "8"], None, ["grad-accum-mismatch"]),
    (["--gradient_accumulation_steps", "1"], None, []),
    ([], None, []),
    (["--gradient_accumulation_steps", "8"], "deepspeed", []),  # raw DeepSpeed derives it from train_batch_size
])
def test_a_json_without_accumulation_is_accelerates_1_not_auto(flag, runner, expected, tmp_path, monkeypatch, capsys):
    """accelerate's DeepSpeedPlugin writes a missing gradient_accumulation_steps as 1 before DeepSpeed starts
    (proved on the real plugin here): the Trainer's --gradient_accumulation_steps 8 then disagrees with it."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    ds = merged(DS_JSON, {"gradient_accumulation_steps": None})
    plugin = DeepSpeedPlugin(hf_ds_config=HfDeepSpeedConfig(merged(ds, {})))
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == 1
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, train=flag, runner=runner)
    found = [f for f in payload["findings"] if f["code"] == "grad-accum-mismatch"]
    assert [f["code"] for f in found] == expected
    for finding in found:
        assert finding["severity"] == "error" and "has no gradient_accumulation_steps" in finding["problem"]
        assert '"gradient_accumulation_steps": "auto"' in finding["fix"]
