"""`hf-scale check`, which DeepSpeed JSON the launch reads (hf_scale.check.deepspeed_file)."""

from __future__ import annotations

import json

import pytest
import yaml
from check_cases import (
    DDP_YAML,
    DS_JSON,
    DS_YAML,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    merged,
    run_cli,
)

from hf_scale.commands.cli import main

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "duplicated-grad-accum": (
        merged(DS_YAML, {"deepspeed_config": {"gradient_accumulation_steps": 1}}),
        DS_JSON,
        [],
        None,
        [],
        "ds-key-duplicated",
        "error",
    ),
    "duplicated-mixed-precision-no": (
        merged(DS_YAML, {"mixed_precision": "no"}),
        DS_JSON,
        [],
        None,
        [],
        "ds-key-duplicated",
        "error",
    ),
    "duplicated-zero-stage": (
        merged(DS_YAML, {"deepspeed_config": {"zero_stage": 2}}),
        DS_JSON,
        [],
        None,
        [],
        "ds-key-duplicated",
        "error",
    ),
    "two-deepspeed-configs": (
        DS_YAML,
        DS_JSON,
        ["--deepspeed", "other.json"],
        None,
        [],
        "deepspeed-config-differs",
        "error",
    ),
    "deepspeed-json-never-used": (
        DDP_YAML,
        DS_JSON,
        [],
        None,
        ["--deepspeed-config", "ds.json"],
        "deepspeed-config-unused",
        "warning",
    ),
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)



def test_deepspeed_file_next_to_yaml_but_not_in_launch_dir_is_an_error(tmp_path, monkeypatch, capsys):
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "acc.yaml").write_text(yaml.safe_dump(DS_YAML))
    (configs / "ds.json").write_text(json.dumps(DS_JSON))
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(["check", "--accelerate-config", "configs/acc.yaml", "--json"], capsys)
    payload = json.loads(out)
    assert code == 1
    assert [(f["code"], f["severity"]) for f in payload["findings"]] == [("deepspeed-config-path", "error")]
    assert payload["summary"]["checked"] == ["configs/acc.yaml", "configs/ds.json"]


def test_deepspeed_file_only_in_launch_dir_is_a_warning(tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "acc.yaml").write_text(yaml.safe_dump(DS_YAML))
    (tmp_path / "ds.json").write_text(json.dumps(DS_JSON))
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(["check", "--accelerate-config", "configs/acc.yaml", "--json"], capsys)
    assert code == 0
    assert [(f["code"], f["severity"]) for f in json.loads(out)["findings"]] == [
        ("deepspeed-config-path", "warning")
    ]


def test_generated_files_check_clean_from_their_directory_and_say_where_to_launch_from_elsewhere(
    tmp_path, monkeypatch, capsys
):
    """`hf-scale generate` names ds_configs/NAME.json relative to the directory holding accelerate_configs/, where
    its launch scripts start `accelerate launch`: no finding there (the demo checks its own files so); from
    another directory the JSON is still found, and the finding says where the launch must start."""
    out = tmp_path / "run"
    assert main(["generate", "--preset", "zero3", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    monkeypatch.chdir(out)
    code, table, _ = run_cli(["check", "--accelerate-config", "accelerate_configs/zero3.yaml"], capsys)
    assert code == 0 and table.splitlines() == [
        "ok: 0 error(s), 0 warning(s) in accelerate_configs/zero3.yaml, ds_configs/zero3.json (runner: trainer)"
    ]
    monkeypatch.chdir(tmp_path)
    code, payload, _ = run_cli(["check", "--accelerate-config", "run/accelerate_configs/zero3.yaml", "--json"], capsys)
    (finding,) = json.loads(payload)["findings"]
    assert code == 0 and (finding["code"], finding["severity"]) == ("deepspeed-config-path", "warning")
    assert "resolves from run/ (where the generated launch scripts start" in finding["problem"]
    assert finding["fix"].startswith("Start `accelerate launch` from run/ (launch/zero3.accelerate.sh there does)")
    checked = json.loads(payload)["summary"]["checked"]
    assert checked == ["run/accelerate_configs/zero3.yaml", "run/ds_configs/zero3.json"]
