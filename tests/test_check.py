"""`hf-scale check`: every check triggered by a small config, clean configs pass clean, bad input exits 2.

Most tests run the real CLI in-process (``hf_scale.cli.main``); a few run it as a subprocess to prove the
exit codes and that no traceback escapes. Nothing from accelerate, DeepSpeed or transformers is mocked.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from hf_scale import check
from hf_scale.cli import main

DATA = Path(__file__).parent / "data" / "check"
REPO = Path(__file__).resolve().parents[1]

DS_YAML = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "DEEPSPEED",
    "deepspeed_config": {"deepspeed_config_file": "ds.json", "zero3_init_flag": False},
    "machine_rank": 0,
    "num_machines": 1,
    "num_processes": 2,
    "use_cpu": False,
}
DS_JSON = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
}
ZERO3_JSON = {
    **DS_JSON,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"},
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
DDP_YAML = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "MULTI_GPU",
    "mixed_precision": "bf16",
    "machine_rank": 0,
    "num_machines": 1,
    "num_processes": 2,
    "use_cpu": False,
}
YAML_ONLY_DS = {
    **DS_YAML,
    "deepspeed_config": {
        "zero_stage": 3,
        "offload_optimizer_device": "none",
        "offload_param_device": "none",
        "gradient_accumulation_steps": 2,
        "zero3_save_16bit_model": True,
        "zero3_init_flag": True,
    },
}
MULTINODE_YAML = {
    **DDP_YAML,
    "num_machines": 2,
    "num_processes": 16,
    "main_process_ip": "10.0.0.1",
    "main_process_port": 29500,
}
FSDP_YAML = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "FSDP",
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 2,
    "use_cpu": False,
    "fsdp_config": {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_sync_module_states": True,
        "reshard_after_forward": True,  # accelerate adds the fsdp_ prefix itself
    },
}


def merged(base: dict, changes: dict) -> dict:
    """``base`` with ``changes`` applied; nested dicts merge, ``None`` deletes a key."""
    result = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds_cfg=None, train=(), runner=None, extra=()):
    """Write the configs into tmp_path, run `hf-scale check --json` there, return (exit code, payload)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(yaml_cfg))
    if ds_cfg is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds_cfg))
    argv = ["check", "--accelerate-config", "acc.yaml", "--json", *extra]
    if runner:
        argv += ["--runner", runner]
    if train:
        argv += ["--", *train]
    code, out, err = run_cli(argv, capsys)
    assert code in (0, 1), err
    payload = json.loads(out)
    assert payload["summary"]["exit_code"] == code
    return code, payload


def codes(payload) -> list[str]:
    return [finding["code"] for finding in payload["findings"]]


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
        DS_YAML,
        DS_JSON,
        ["--loop", "accelerate", "--hf_scale_config", "x.yaml", "--model_name_or_path", "m", "--bf16"],
        None,
    ),
}


@pytest.mark.parametrize("case", sorted(CLEAN_CASES))
def test_clean_configs_report_nothing_and_exit_0(case, tmp_path, monkeypatch, capsys):
    yaml_cfg, ds_cfg, train, runner = CLEAN_CASES[case]
    code, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds_cfg, train, runner)
    assert (code, payload["findings"]) == (0, [])
    assert payload["summary"]["errors"] == payload["summary"]["warnings"] == 0


def test_clean_fsdp_config_only_warns_when_this_machine_has_no_gpu(tmp_path, monkeypatch, capsys):
    code, payload = check_json(tmp_path, monkeypatch, capsys, FSDP_YAML, train=["--bf16"])
    assert code == 0
    expected = ["fsdp-no-gpu"] if torch.cuda.device_count() == 0 else []
    assert codes(payload) == expected
    assert all(f["severity"] == "warning" for f in payload["findings"])


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
        "train-batch-mismatch",
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
    "auto-betas-accelerate-loop": (DS_YAML, ZERO3_JSON, [], "accelerate", [], "auto-unresolvable", "error"),
    "auto-lr-raw-deepspeed": (
        DS_YAML,
        merged(
            DS_JSON,
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0,
                "bf16": {"enabled": True},
                "zero_optimization": {"reduce_bucket_size": 500000000},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            },
        ),
        [],
        "deepspeed",
        [],
        "auto-unresolvable",
        "error",
    ),
    "auto-stage3-key-below-zero3-trainer": (
        DS_YAML,
        merged(DS_JSON, {"zero_optimization": {"stage3_prefetch_bucket_size": "auto"}}),
        [],
        None,
        [],
        "auto-unresolvable",
        "error",
    ),
    "unknown-deepspeed_config-key": (
        merged(DS_YAML, {"deepspeed_config": {"zero3_init_flg": True}}),
        DS_JSON,
        [],
        None,
        [],
        "unknown-accelerate-key",
        "error",
    ),
    "unknown-fsdp_config-key": (
        merged(FSDP_YAML, {"fsdp_config": {"fsdp_sharding_stratgy": "FULL_SHARD"}}),
        None,
        [],
        None,
        [],
        "unknown-accelerate-key",
        "error",
    ),
    "unknown-top-level-yaml-key": (
        merged(DDP_YAML, {"num_process": 2}),
        None,
        [],
        None,
        [],
        "unknown-accelerate-key",
        "error",
    ),
    "accelerate-rejects-enum": (
        merged(DDP_YAML, {"distributed_type": "MULTI_GPUS"}),
        None,
        [],
        None,
        [],
        "accelerate-config-invalid",
        "error",
    ),
    "unknown-deepspeed-top-level-key": (
        DS_YAML,
        merged(DS_JSON, {"gradient_acumulation_steps": 2}),
        [],
        None,
        [],
        "unknown-deepspeed-key",
        "error",
    ),
    "unknown-zero-key": (
        DS_YAML,
        merged(DS_JSON, {"zero_optimization": {"overlap_com": True}}),
        [],
        None,
        [],
        "unknown-deepspeed-key",
        "error",
    ),
    "unknown-offload-key": (
        DS_YAML,
        merged(ZERO3_JSON, {"zero_optimization": {"offload_param": {"pin_memry": True}}}),
        [],
        None,
        [],
        "unknown-deepspeed-key",
        "error",
    ),
    "deepspeed-rejects-stage": (
        DS_YAML,
        merged(DS_JSON, {"zero_optimization": {"stage": 4}}),
        [],
        None,
        [],
        "deepspeed-config-invalid",
        "error",
    ),
    "use-cpu-two-processes": (
        merged(DDP_YAML, {"use_cpu": True, "distributed_type": "MULTI_CPU"}),
        None,
        [],
        None,
        [],
        "cpu-single-process",
        "error",
    ),
    "use-cpu-training-arg": (
        DDP_YAML,
        None,
        ["--use_cpu", "--bf16"],
        None,
        [],
        "cpu-single-process",
        "warning",
    ),
    "cpu-train-py-flag": (DDP_YAML, None, ["--cpu", "--bf16"], None, [], "cpu-single-process", "warning"),
    "fsdp-with-use-cpu": (
        merged(FSDP_YAML, {"use_cpu": True, "num_processes": 1}),
        None,
        [],
        None,
        [],
        "use-cpu-ignores-plugin",
        "error",
    ),
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
    "multinode-no-ip": (
        merged(MULTINODE_YAML, {"main_process_ip": None}),
        None,
        [],
        None,
        [],
        "multinode-no-main-ip",
        "error",
    ),
    "processes-per-machine-written-as-total": (
        merged(MULTINODE_YAML, {"num_processes": 9}),
        None,
        [],
        None,
        [],
        "processes-not-multiple-of-machines",
        "error",
    ),
    "machine-rank-one-based": (
        merged(MULTINODE_YAML, {"machine_rank": 2}),
        None,
        [],
        None,
        [],
        "machine-rank-out-of-range",
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
    "num-processes-a-word": (merged(DDP_YAML, {"num_processes": "two"}), None, [], None, [],
                             "accelerate-value-invalid", "error"),
    "negative-micro-batch": (DS_YAML, merged(DS_JSON, {"train_micro_batch_size_per_gpu": -2}), [], None, [],
                             "deepspeed-value-invalid", "error"),
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
    yaml_cfg, ds_cfg, train, runner, extra, code, severity = TRIGGERS[case]
    (tmp_path / "other.json").write_text(json.dumps(DS_JSON))
    exit_code, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds_cfg, train, runner, extra)
    found = [f for f in payload["findings"] if f["code"] == code]
    assert found, codes(payload)
    assert {f["severity"] for f in found} == {severity}
    for finding in found:
        assert finding["file"] and finding["key"] and finding["problem"] and finding["fix"]
        assert finding["where"] == f"{finding['file']}:{finding['key']}"
    errors = [f for f in payload["findings"] if f["severity"] == "error"]
    assert exit_code == (1 if errors else 0)


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


def test_train_batch_finding_shows_the_arithmetic(tmp_path, monkeypatch, capsys):
    ds = merged(
        DS_JSON,
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1},
    )
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(DS_YAML, {"num_processes": 3}), ds)
    (finding,) = [f for f in payload["findings"] if f["code"] == "train-batch-mismatch"]
    assert "4 x 1 x 3 = 12" in finding["problem"]
    assert "12" in finding["fix"]


def test_each_unresolvable_auto_key_is_listed(tmp_path, monkeypatch, capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ZERO3_JSON, runner="accelerate")
    keys = sorted(f["key"] for f in payload["findings"] if f["code"] == "auto-unresolvable")
    assert keys == ["optimizer.params.betas", "optimizer.params.eps"]


def test_raw_deepspeed_runner_resolves_no_auto(tmp_path, monkeypatch, capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, DS_JSON, runner="deepspeed")
    keys = {f["key"] for f in payload["findings"] if f["code"] == "auto-unresolvable"}
    assert keys == set(check._auto_paths(DS_JSON))


def test_misspelled_keys_get_the_closest_known_key_as_fix(tmp_path, monkeypatch, capsys):
    yaml_cfg = merged(DS_YAML, {"deepspeed_config": {"zero3_init_flg": True}})
    ds = merged(DS_JSON, {"zero_optimization": {"overlap_com": True}, "wall_clock_breakdwon": False})
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds)
    fixes = {f["key"]: f["fix"] for f in payload["findings"]}
    assert "`zero3_init_flag`" in fixes["deepspeed_config.zero3_init_flg"]
    assert "`overlap_comm`" in fixes["zero_optimization.overlap_com"]
    assert "`wall_clock_breakdown`" in fixes["wall_clock_breakdwon"]


def test_fsdp_gpu_warning_depends_on_the_gpu_count(tmp_path):
    (tmp_path / "fsdp.yaml").write_text(yaml.safe_dump(FSDP_YAML))
    for gpus, expected in ((0, ["fsdp-no-gpu"]), (8, [])):
        inputs = check.load_inputs(str(tmp_path / "fsdp.yaml"), gpu_count=gpus, cwd=tmp_path)
        assert [f.code for f in check.run_checks(inputs)] == expected


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
        "warnings": 1,
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


BAD_INPUTS = {
    "missing-yaml": (["--accelerate-config", "nope.yaml"], "--accelerate-config nope.yaml: not found"),
    "no-yaml-flag": ([], "--accelerate-config A.yaml is required"),
    "yaml-syntax": (["--accelerate-config", "broken.yaml"], "not valid YAML"),
    "yaml-not-mapping": (["--accelerate-config", "list.yaml"], "expected a mapping"),
    "json-syntax": (
        ["--accelerate-config", "acc.yaml", "--deepspeed-config", "broken.json"],
        "not valid JSON",
    ),
    "missing-json": (
        ["--accelerate-config", "acc.yaml", "--deepspeed-config", "nope.json"],
        "nope.json: not found",
    ),
    "referenced-json-missing": (
        ["--accelerate-config", "dangling.yaml"],
        "deepspeed_config_file='gone.json'",
    ),
    "unknown-runner": (["--accelerate-config", "acc.yaml", "--runner", "torchrun"], "--runner 'torchrun'"),
    "bad-training-arg": (
        ["--accelerate-config", "acc.yaml", "--", "--per_device_train_batch_size", "four"],
        "invalid int value",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_unreadable_input_is_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(DDP_YAML))
    (tmp_path / "broken.yaml").write_text("distributed_type: [DEEPSPEED\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.json").write_text('{"train_batch_size": 8,}')
    (tmp_path / "dangling.yaml").write_text(
        yaml.safe_dump(merged(DS_YAML, {"deepspeed_config": {"deepspeed_config_file": "gone.json"}}))
    )
    argv, message = BAD_INPUTS[case]
    code, out, err = run_cli(["check", *argv], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("hf-scale: error: ") and message in err


def documented_codes() -> set[str]:
    return {code for fn in check.CHECKS for code in check.check_codes(fn)}


def test_help_explains_every_code_runner_and_exit_code(capsys):
    code, out, _ = run_cli(["check", "--help"], capsys)
    assert code == 0
    documented = documented_codes()
    assert len(documented) >= 20
    for name in [*documented, *check.RUNNERS, "exit codes", "--json", "example"]:
        assert name in out


def test_every_documented_code_has_a_triggering_test():
    emitted = {TRIGGERS[case][5] for case in TRIGGERS} | {"deepspeed-config-path", "fsdp-no-gpu"}
    assert emitted == documented_codes()


# ---- the knowledge taken from the libraries is proven against them ------------------------------------


@pytest.mark.parametrize("key", check.DS_FILE_CONFLICTING_YAML_KEYS)
def test_accelerate_really_rejects_each_duplicated_key(key, monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", key)
    with pytest.raises(ValueError, match="will be ignored"):
        DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}})


def test_accelerate_accepts_the_other_deepspeed_keys_next_to_a_file(monkeypatch):
    from accelerate.utils import DeepSpeedPlugin

    others = sorted(check.known_section_keys("deepspeed_config") - set(check.DS_FILE_CONFLICTING_YAML_KEYS))
    assert "zero3_init_flag" in others and "deepspeed_config_file" in others
    monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", ",".join(others))
    DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}})


def test_keys_written_by_accelerate_config_questionnaire_are_known():
    from accelerate.commands.config import cluster

    source = inspect.getsource(cluster)
    for section in ("deepspeed_config", "fsdp_config"):
        written = set(re.findall(rf'{section}\["(\w+)"\]', source))
        assert written, section
        assert written <= check.known_section_keys(section), written - check.known_section_keys(section)
    assert "fsdp_ignored_modules" in check.known_section_keys("fsdp_config")


def test_auto_resolution_lists_match_the_libraries_source():
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    trainer_source = inspect.getsource(HfTrainerDeepSpeedConfig)
    filled = set(re.findall(r'fill_(?:match|only)\(\s*"([\w.]+)"', trainer_source))
    trainer_lists = check.TRAINER_RESOLVED | check.TRAINER_RESOLVED_ZERO3_ONLY
    assert filled <= trainer_lists, filled - trainer_lists
    assert trainer_lists - filled <= check._PLUGIN_RESOLVED
    plugin_source = inspect.getsource(DeepSpeedPlugin.__post_init__)
    for yaml_key, path in check.YAML_TO_DS_PATH.items():
        assert f'"{yaml_key}": "{path}"' in plugin_source
    accelerate_source = inspect.getsource(Accelerator._prepare_deepspeed) + inspect.getsource(
        DeepSpeedPlugin.set_mixed_precision
    )
    for path in check.ACCELERATE_RESOLVED - check._PLUGIN_RESOLVED:
        assert f'"{path}"' in accelerate_source, path
    assert '"optimizer.params.betas"' not in accelerate_source


# ---- as a real process: exit codes and no traceback ------------------------------------------------------


def run_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_scale.cli", "check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_process_exit_1_with_table_for_the_other_project(tmp_path):
    for name in ("other_project.yaml", "other_project_ds.json"):
        shutil.copy(DATA / name, tmp_path / name)
    # Without --per_device_train_batch_size the Trainer's default (8) disagrees with the JSON's 2 as well.
    result = run_process(["--accelerate-config", "other_project.yaml", "--", "--bf16"], tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("SEVERITY")
    assert "micro-batch-mismatch" in result.stdout
    assert "problems found: 14 error(s), 1 warning(s)" in result.stdout


def test_process_exit_0_and_pure_json_on_stdout_for_a_clean_config(tmp_path):
    for name in ("clean_zero2.yaml", "clean_zero2.json"):
        shutil.copy(DATA / name, tmp_path / name)
    result = run_process(["--accelerate-config", "clean_zero2.yaml", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["findings"] == []


def test_process_exit_2_one_line_for_a_missing_file(tmp_path):
    result = run_process(["--accelerate-config", "missing.yaml"], tmp_path)
    assert result.returncode == 2
    assert result.stderr == "hf-scale: error: --accelerate-config missing.yaml: not found\n"
    assert result.stdout == ""
