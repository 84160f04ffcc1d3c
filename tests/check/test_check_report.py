"""`hf-scale check` as a command: clean configs exit 0, the table and --json output, --help documents every code
(each with a triggering case in a family's test file), exit codes as a real process, a hand-written config from
another project."""

from __future__ import annotations

import importlib
import json
import re
import shutil
from pathlib import Path

import pytest
from check_cases import (
    DATA,
    DDP_YAML,
    DS_JSON,
    DS_YAML,
    MULTINODE_YAML,
    REPO,
    YAML_ONLY_DS,
    ZERO3_JSON,
    check_json,
    codes,
    documented_codes,
    merged,
    run_cli,
    run_process,
)
from test_docs import github_slug

from hf_scale.check.codes import CATALOGUE, EITHER, ERROR, FAMILIES, FILES, MANIFEST, PLAN, WARNING
from hf_scale.commands import check

HERE = Path(__file__).parent
CHECK_MODULES = ("accelerate_yaml", "deepspeed_file", "batch", "precision", "deepspeed_json", "trainer_values",
                 "topology", "zero", "fp8", "parallelism", "qlora", "moe")


def all_triggers() -> dict[str, tuple]:
    """Every family's TRIGGERS (tests/check/test_check_FAMILY.py)."""
    return {case: trigger for family in CHECK_MODULES
            for case, trigger in importlib.import_module(f"test_check_{family}").TRIGGERS.items()}


def test_each_family_triggers_only_its_own_codes():
    """A case lives in the test file of the module whose check reports it."""
    for family in CHECK_MODULES:
        emitted = {trigger[5] for trigger in importlib.import_module(f"test_check_{family}").TRIGGERS.values()}
        own = {entry.code for entry in CATALOGUE if entry.module == family}
        assert emitted and emitted <= own, (family, emitted - own)
        # ...and the catalogue names the module whose checks run in CHECKS
        assert f"hf_scale.check.{family}" in {fn.__module__ for fn in check.CHECKS}, family


CLEAN_CASES = {
    "zero2-auto-trainer": (DS_YAML, DS_JSON, ["--per_device_train_batch_size", "4", "--bf16"], None),
    "zero3-offload-trainer": (DS_YAML, ZERO3_JSON, ["--gradient_accumulation_steps", "4"], None),
    "zero2-resolved-deepspeed-runner": (
        DS_YAML,
        {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2},
        },
        [],
        "deepspeed",
    ),
    "zero2-accelerate-runner": (
        DS_YAML,
        merged(
            DS_JSON,
            {
                "optimizer": {
                    "type": "AdamW",
                    "params": {"lr": "auto", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": "auto"},
                }
            },
        ),
        [],
        "accelerate",
    ),
    "yaml-only-deepspeed": (YAML_ONLY_DS, None, ["--gradient_accumulation_steps", "2"], None),
    "ddp-bf16": (DDP_YAML, None, ["--bf16", "--per_device_train_batch_size", "8"], None),
    "ddp-multinode": (MULTINODE_YAML, None, [], None),
    "train-py-flags-tolerated": (
        merged(DS_YAML, {"num_processes": 8}),  # the world size of hf_scale_configs/zero2.yaml
        DS_JSON,
        ["--loop", "accelerate", "--hf_scale_config", str(REPO / "hf_scale_configs" / "zero2.yaml"),
         "--model_name_or_path", "m", "--bf16"],
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(CLEAN_CASES))
def test_clean_configs_report_nothing_and_exit_0(case, tmp_path, monkeypatch, capsys):
    yaml_cfg, ds_cfg, train, runner = CLEAN_CASES[case]
    code, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds_cfg, train, runner)
    assert (code, payload["findings"]) == (0, [])
    assert payload["summary"]["errors"] == payload["summary"]["warnings"] == 0


def test_disagreement_findings_name_both_values(tmp_path, monkeypatch, capsys):
    _, payload = check_json(
        tmp_path,
        monkeypatch,
        capsys,
        DS_YAML,
        merged(DS_JSON, {"gradient_accumulation_steps": 4}),
        ["--gradient_accumulation_steps", "2"],
    )
    (finding,) = [f for f in payload["findings"] if f["code"] == "grad-accum-mismatch"]
    assert finding["values"] == {
        "ds.json:gradient_accumulation_steps": 4,
        "training args:--gradient_accumulation_steps": 2,
    }
    assert "=4" in finding["problem"] and "=2" in finding["problem"]


def test_misspelled_keys_get_the_closest_known_key_as_fix(tmp_path, monkeypatch, capsys):
    yaml_cfg = merged(DS_YAML, {"deepspeed_config": {"zero3_init_flg": True}})
    ds = merged(DS_JSON, {"zero_optimization": {"overlap_com": True}, "wall_clock_breakdwon": False})
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds)
    fixes = {f["key"]: f["fix"] for f in payload["findings"]}
    assert "`zero3_init_flag`" in fixes["deepspeed_config.zero3_init_flg"]
    assert "`overlap_comm`" in fixes["zero_optimization.overlap_com"]
    assert "`wall_clock_breakdown`" in fixes["wall_clock_breakdwon"]


OTHER_PROJECT_FINDINGS = {
    ("unknown-accelerate-key", "other_project.yaml:deepspeed_config.zero3_save_16bit_modle"),
    ("ds-key-duplicated", "other_project.yaml:deepspeed_config.gradient_accumulation_steps"),
    ("ds-key-duplicated", "other_project.yaml:deepspeed_config.offload_optimizer_device"),
    ("ds-key-duplicated", "other_project.yaml:mixed_precision"),
    ("grad-accum-mismatch", "other_project.yaml:deepspeed_config.gradient_accumulation_steps"),
    ("train-batch-mismatch", "other_project_ds.json:train_batch_size"),
    ("precision-mismatch", "other_project.yaml:mixed_precision"),
    ("precision-mismatch", "other_project_ds.json:bf16.enabled"),
    ("unknown-deepspeed-key", "other_project_ds.json:zero_optimization.overlap_com"),
    ("unknown-deepspeed-key", "other_project_ds.json:wall_clock_breakdwon"),
    ("nvme-without-path", "other_project_ds.json:zero_optimization.offload_param.device"),
    (
        "zero3-no-16bit-save",
        "other_project_ds.json:zero_optimization.stage3_gather_16bit_weights_on_model_save",
    ),
    ("multinode-no-main-ip", "other_project.yaml:main_process_ip"),
    ("machine-rank-out-of-range", "other_project.yaml:machine_rank"),
    ("ds-trainer-mismatch", "other_project_ds.json:optimizer.params.lr"),
}


def test_hand_written_config_from_another_project_reports_every_problem(monkeypatch, capsys):
    monkeypatch.chdir(DATA)
    code, out, _ = run_cli(
        [
            "check",
            "--accelerate-config",
            "other_project.yaml",
            "--json",
            "--",
            "--bf16",
            "--per_device_train_batch_size",
            "2",
        ],
        capsys,
    )
    payload = json.loads(out)
    assert code == 1
    assert {(f["code"], f["where"]) for f in payload["findings"]} == OTHER_PROJECT_FINDINGS
    assert payload["summary"] == {
        "errors": 13,
        "warnings": 2,
        "checked": ["other_project.yaml", "other_project_ds.json", "training args"],
        "runner": "trainer",
        "exit_code": 1,
    }


def test_human_output_is_a_table_with_a_summary_line(monkeypatch, capsys):
    monkeypatch.chdir(DATA)
    code, out, _ = run_cli(["check", "--accelerate-config", "other_project.yaml"], capsys)
    assert code == 1
    lines = out.splitlines()
    assert lines[0].split() == ["SEVERITY", "CODE", "WHERE", "(FILE:KEY)", "PROBLEM", "FIX"]
    assert set(lines[1]) == {"-", " "}
    assert lines[-1].startswith("problems found: ")
    for code_name in ("ds-key-duplicated", "nvme-without-path", "machine-rank-out-of-range"):
        assert any(line.split()[1:2] == [code_name] for line in lines[2:])


def test_warnings_alone_exit_0(tmp_path, monkeypatch, capsys):
    ds = merged(ZERO3_JSON, {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": False}})
    code, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    assert code == 0
    assert codes(payload) == ["zero3-no-16bit-save"]
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(["check", "--accelerate-config", "acc.yaml"], capsys)
    assert code == 0
    assert out.splitlines()[-1].startswith("ok with warnings: 0 error(s), 1 warning(s)")


def test_help_explains_every_code_runner_and_exit_code(capsys):
    code, out, _ = run_cli(["check", "--help"], capsys)
    assert code == 0
    assert len(CATALOGUE) >= 70
    for entry in CATALOGUE:  # the config files', --manifest's and --plan's codes, with their severity
        severity = "" if entry.severity == ERROR else f" ({entry.severity})"
        assert f"{entry.code}{severity}: " in out, entry
    for name in [*check.RUNNERS, "exit codes", "--json", "example"]:
        assert name in out


# The tests that assert each --manifest code is reported (with the configs that trigger it).
MANIFEST_TESTS = ("test_check_cluster.py", "test_check_manifest_values.py")


def test_every_catalogued_code_has_a_triggering_test():
    """The config files' codes: a case in a family's TRIGGERS (deepspeed-config-path: its own tests in
    test_check_deepspeed_file.py, which depend on the working directory); --plan's: test_check_time_budget.CODES, all
    reported by one of its tests; --manifest's: an expected code in the manifest tests' assertions."""
    emitted = {trigger[5] for trigger in all_triggers().values()} | {"deepspeed-config-path"}
    assert emitted == documented_codes(FILES)
    assert set(importlib.import_module("test_check_time_budget").CODES) == documented_codes(PLAN)
    tests = "".join((HERE / name).read_text() for name in MANIFEST_TESTS)
    assert {code for code in documented_codes(MANIFEST) if f'"{code}"' in tests} == documented_codes(MANIFEST)


def test_a_finding_with_a_code_or_severity_the_catalogue_lacks_cannot_exist():
    with pytest.raises(ValueError, match="'grad-acum-mismatch' is not in hf_scale.check.codes.CATALOGUE"):
        check.Finding(ERROR, "grad-acum-mismatch", "ds.json", "gradient_accumulation_steps", "problem", "fix")
    with pytest.raises(ValueError, match="severity 'warning', the catalogue says 'error'"):
        check.Finding(WARNING, "fp16-and-bf16", "ds.json", "fp16.enabled", "problem", "fix")
    assert check.Finding(WARNING, "grad-accum-mismatch", "ds.json", "x", "p", "f").severity == WARNING  # EITHER


DOC_SEVERITY = {"error": ERROR, "warning": WARNING, "error / warning": EITHER}


def docs_tables() -> dict[str, dict[str, str]]:
    """docs/check.md's code tables by the anchor of the heading above each: code -> severity."""
    tables: dict[str, dict[str, str]] = {}
    anchor, fenced = "", False
    for line in (REPO / "docs" / "check.md").read_text().splitlines():
        fenced ^= line.startswith("```")
        if line.startswith("#") and not fenced:
            anchor = github_slug(line.lstrip("#").strip())
        elif line.startswith("| `"):
            name, severity = (cell.strip() for cell in line.split("|")[1:3])
            for code in re.findall(r"`([a-z0-9]+(?:-[a-z0-9]+)+)`", name):
                tables.setdefault(anchor, {})[code] = DOC_SEVERITY.get(severity, severity)
    return tables


def test_the_docs_tables_list_exactly_the_catalogue():
    """Each family's table in docs/check.md (the config files', --plan's, --manifest's) has one row per code of the
    catalogue, with its severity, and no other code."""
    tables = docs_tables()
    assert set(tables) == {family.anchor for family in FAMILIES}
    for family in FAMILIES:
        assert tables[family.anchor] == {e.code: e.severity for e in CATALOGUE if e.family is family}, family.name


def test_process_exit_1_with_table_for_the_other_project(tmp_path):
    for name in ("other_project.yaml", "other_project_ds.json"):
        shutil.copy(DATA / name, tmp_path / name)
    # Without --per_device_train_batch_size the Trainer's default (8) disagrees with the JSON's 2 as well (a warning:
    # train.py takes the JSON's value; so is the default --learning_rate against the JSON's lr).
    result = run_process(["--accelerate-config", "other_project.yaml", "--", "--bf16"], tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("SEVERITY")
    assert "micro-batch-mismatch" in result.stdout
    assert "problems found: 13 error(s), 3 warning(s)" in result.stdout


def test_process_exit_0_and_pure_json_on_stdout_for_a_clean_config(tmp_path):
    for name in ("clean_zero2.yaml", "clean_zero2.json"):
        shutil.copy(DATA / name, tmp_path / name)
    result = run_process(["--accelerate-config", "clean_zero2.yaml", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["findings"] == []


def test_process_exit_2_one_line_for_a_missing_file(tmp_path):
    result = run_process(["--accelerate-config", "missing.yaml"], tmp_path)
    assert result.returncode == 2
    assert result.stderr == ("hf-scale: error: --accelerate-config missing.yaml: not found; "
                             "expected an accelerate config YAML\n")
    assert result.stdout == ""


def test_a_value_in_the_json_is_never_fixed_in_the_yaml(tmp_path, monkeypatch, capsys):
    ds = merged(ZERO3_JSON, {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": False}})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(ds, {"optimizer": None}))
    for finding in payload["findings"]:
        assert finding["file"] == "ds.json" and "In ds.json" in finding["fix"] and "acc.yaml" not in finding["fix"]
