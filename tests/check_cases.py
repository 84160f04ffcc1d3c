"""Shared configs and helpers of the `hf-scale check` tests (tests/check/test_check_*.py, one file per family of
checks in hf_scale/check/). Most tests run the real CLI in-process (``hf_scale.commands.cli.main``); a few run it as a
subprocess to prove the exit codes and that no traceback escapes. Nothing from accelerate, DeepSpeed or
transformers is mocked."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from hf_scale.check.codes import CATALOGUE, FILES, Family
from hf_scale.commands import check
from hf_scale.commands.cli import main

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
        "fsdp_state_dict_type": "FULL_STATE_DICT",  # SHARDED: `fsdp-sharded-final-save`
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


def documented_codes(family: Family = FILES) -> set[str]:
    """The codes hf_scale.check.codes catalogues for one family of inputs (default: the config files)."""
    return {entry.code for entry in CATALOGUE if entry.family is family}


def run_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hf_scale", "check", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def _fix_names_where_the_value_is(finding: dict) -> bool:
    """The fix names the file holding the value (or the training args) and the key (or flag)."""
    file_named = (
        finding["file"] == check.TRAINING_ARGS and ("training args" in finding["fix"] or "--" in finding["fix"])
    ) or Path(finding["file"]).name in finding["fix"]
    key = finding["key"].split(" ")[0]
    key_named = key == "(file)" or any(part.split(".")[-1] in finding["fix"] for part in key.split("/"))
    return file_named and key_named


WRONG_KINDS = ["a word", 7, -1, True, [1], {"a": 1}, 1.5, ""]


def _set(data: dict, path: str, value) -> dict:
    data = merged(data, {})
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data

def assert_reports_its_problem(trigger, tmp_path, monkeypatch, capsys) -> None:
    """A TRIGGERS case: its code is reported with its severity, a file, key, problem and fix."""
    yaml_cfg, ds_cfg, train, runner, extra, code, severity = trigger
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


def assert_every_fix_names_where_the_value_is(trigger, tmp_path, monkeypatch, capsys) -> None:
    yaml_cfg, ds_cfg, train, runner, extra, _, _ = trigger
    (tmp_path / "other.json").write_text(json.dumps(DS_JSON))
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, ds_cfg, train, runner, extra)
    for finding in payload["findings"]:
        assert _fix_names_where_the_value_is(finding), finding

