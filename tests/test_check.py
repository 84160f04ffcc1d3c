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


@pytest.mark.parametrize(
    ("gpus", "expected"), [(None, []), ("0", ["fsdp-no-gpu"]), ("2", []), ("1", ["processes-exceed-gpus"])]
)
def test_gpu_findings_describe_the_target_given_by_gpus_never_this_machine(
    gpus, expected, tmp_path, monkeypatch, capsys
):
    """Without --gpus nothing is said about GPUs, whatever the machine running the check has."""
    extra = [] if gpus is None else ["--gpus-per-machine", gpus]
    _, payload = check_json(tmp_path, monkeypatch, capsys, FSDP_YAML, train=["--bf16"], extra=extra)
    assert codes(payload) == expected
    for finding in payload["findings"]:
        assert "--gpus-per-machine" in finding["problem"] and "this machine" not in finding["problem"]


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
    "one-gpu-id-for-two-processes": (
        merged(DDP_YAML, {"gpu_ids": "0"}),
        None,
        [],
        None,
        [],
        "accelerate-launch-fails",
        "error",
    ),
    "main-ip-not-an-address": (
        merged(MULTINODE_YAML, {"main_process_ip": "1234"}),
        None,
        [],
        None,
        [],
        "main-ip-invalid",
        "error",
    ),
    "main-ip-command-substitution": (
        merged(DDP_YAML, {"main_process_ip": "$(reboot)"}),
        None,
        [],
        None,
        [],
        "main-ip-invalid",
        "error",
    ),
    "main-ip-hf-scale-placeholder": (
        merged(MULTINODE_YAML, {"main_process_ip": "main-node.invalid"}),
        None,
        [],
        None,
        [],
        "main-ip-placeholder",
        "warning",
    ),
    "fsdp-on-gpu-less-target": (FSDP_YAML, None, [], None, ["--gpus-per-machine", "0"], "fsdp-no-gpu", "warning"),
    "more-processes-than-gpus": (
        merged(DDP_YAML, {"num_processes": 8}),
        None,
        [],
        None,
        ["--gpus", "4"],
        "processes-exceed-gpus",
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


def test_fsdp_gpu_warning_depends_on_the_target_gpu_count(tmp_path):
    (tmp_path / "fsdp.yaml").write_text(yaml.safe_dump(FSDP_YAML))
    for gpus, expected in ((None, []), (0, ["fsdp-no-gpu"]), (8, [])):
        inputs = check.load_inputs(str(tmp_path / "fsdp.yaml"), gpus_per_machine=gpus, cwd=tmp_path)
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
        "errors": 14,
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
    "negative-gpus": (
        ["--accelerate-config", "acc.yaml", "--gpus-per-machine", "-1"],
        "--gpus-per-machine -1: must be >= 0",
    ),
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
    emitted = {TRIGGERS[case][5] for case in TRIGGERS} | {"deepspeed-config-path"}
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
    assert "problems found: 15 error(s), 1 warning(s)" in result.stdout


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


# ---- wrong findings fixed by class (issue 13) --------------------------------------------------------


def _fix_names_where_the_value_is(finding: dict) -> bool:
    """The fix names the file holding the value (or the training args) and the key (or flag)."""
    file_named = (
        finding["file"] == check.TRAINING_ARGS and ("training args" in finding["fix"] or "--" in finding["fix"])
    ) or Path(finding["file"]).name in finding["fix"]
    key = finding["key"].split(" ")[0]
    key_named = key == "(file)" or any(part.split(".")[-1] in finding["fix"] for part in key.split("/"))
    return file_named and key_named


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    yaml_cfg, ds_cfg, train, runner, extra, _, _ = TRIGGERS[case]
    (tmp_path / "other.json").write_text(json.dumps(DS_JSON))
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds_cfg, train, runner, extra)
    for finding in payload["findings"]:
        assert _fix_names_where_the_value_is(finding), finding


def test_a_value_in_the_json_is_never_fixed_in_the_yaml(tmp_path, monkeypatch, capsys):
    ds = merged(ZERO3_JSON, {"zero_optimization": {"stage3_gather_16bit_weights_on_model_save": False}})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(ds, {"optimizer": None}))
    for finding in payload["findings"]:
        assert finding["file"] == "ds.json" and "In ds.json" in finding["fix"] and "acc.yaml" not in finding["fix"]


@pytest.mark.parametrize("spelling", check._GATHER_SPELLINGS)
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


def test_comment_keys_are_fine_where_deepspeed_ignores_them(tmp_path, monkeypatch, capsys):
    ds = {**DS_JSON, "_comment": "ZeRO-2 for 8 GPUs", "_read_the_docs": "https://www.deepspeed.ai", "comment": "x"}
    yaml_cfg = merged(DS_YAML, {"deepspeed_config": {"_comment": "see ds.json"}})
    code, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds)
    assert (code, payload["findings"]) == (0, [])


def test_a_comment_key_where_deepspeed_refuses_it_is_an_error_without_a_rename(tmp_path, monkeypatch, capsys):
    ds = merged(DS_JSON, {"zero_optimization": {"_comment": "stage 2 for 8 GPUs"}})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    (finding,) = payload["findings"]
    assert (finding["code"], finding["key"]) == ("unknown-deepspeed-key", "zero_optimization._comment")
    assert "comments included" in finding["problem"] and "remove `_comment`" in finding["fix"]


def test_no_rename_to_an_unrelated_key():
    assert check._closest("_comment", {"comet", "comms_logger"}) is None
    assert check._closest("wandb_project", {"wandb", "comet"}) is None
    assert check._closest("overlap_com", {"overlap_comm", "stage"}) == "overlap_comm"


@pytest.mark.parametrize(
    ("rank", "expected"),
    [("1", []), (1, []), ("0", []), (2, ["machine-rank-out-of-range"]), ("one", ["accelerate-launch-fails"])],
)
def test_machine_rank_is_read_the_way_accelerate_launch_reads_it(rank, expected, tmp_path, monkeypatch, capsys):
    """accelerate int()s machine_rank when it launches: a quoted "1" is rank 1, "one" fails in accelerate."""
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(MULTINODE_YAML, {"machine_rank": rank}))
    assert codes(payload) == expected


def test_every_invalid_deepspeed_key_is_reported_not_only_the_first(tmp_path, monkeypatch, capsys):
    ds = merged(
        DS_JSON,
        {
            "zero_optimization": {"overlap_com": True, "reduce_scatterr": True},
            "comms_logger": {"enabledd": True},
            "tensorboard": {"enabled": False, "enabld": True},
            "wall_clock_breakdwon": False,
        },
    )
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    assert sorted(f["key"] for f in payload["findings"] if f["code"] == "unknown-deepspeed-key") == [
        "comms_logger.enabledd",
        "tensorboard.enabld",
        "wall_clock_breakdwon",
        "zero_optimization.overlap_com",
        "zero_optimization.reduce_scatterr",
    ]
    fixes = {f["key"]: f["fix"] for f in payload["findings"]}
    assert "`enabled`" in fixes["comms_logger.enabledd"] and "`enabled`" in fixes["tensorboard.enabld"]


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
    accepted, _, _ = check._deepspeed_accepts_batch(total, micro, accum, world)
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(DS_YAML, {"num_processes": world}), ds,
                            runner="deepspeed")
    batch = [f for f in payload["findings"] if f["code"].startswith("train-batch")]
    assert bool(batch) != accepted, batch
