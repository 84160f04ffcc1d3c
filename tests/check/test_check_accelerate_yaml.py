"""`hf-scale check`, the accelerate YAML on its own (hf_scale.check.accelerate_yaml): keys accelerate refuses or
ignores, values of the wrong type or range (accelerate copies them through and fails only at launch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from check_cases import (
    DDP_YAML,
    DS_JSON,
    DS_YAML,
    FSDP_YAML,
    WRONG_KINDS,
    ZERO3_JSON,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
)

from hf_scale.commands import check

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "fsdp2-forward-prefetch": (
        merged(FSDP_YAML, {"fsdp_config": {"fsdp_version": 2, "fsdp_forward_prefetch": True}}),
        None,
        [],
        None,
        [],
        "fsdp2-option-ignored",
        "warning",
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
    "num-processes-a-word": (merged(DDP_YAML, {"num_processes": "two"}), None, [], None, [],
                             "accelerate-value-invalid", "error"),
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)



# machine_rank and main_process_ip have their own checks, which read them as `accelerate launch` does
# (tests/check/test_check_topology.py: a quoted "1" is rank 1, "one" fails in accelerate; `main-ip-invalid`).
YAML_CASES = {
    "num_processes: two": ({"num_processes": "two"}, "num_processes"),
    "num_processes: 0": ({"num_processes": 0}, "num_processes"),
    "num_processes: true": ({"num_processes": True}, "num_processes"),
    "num_processes: 2.5": ({"num_processes": 2.5}, "num_processes"),
    "num_machines: -1": ({"num_machines": -1}, "num_machines"),
    "main_process_port: 70000": ({"main_process_port": 70000}, "main_process_port"),
    "main_process_port: '29500'": ({"main_process_port": "29500"}, "main_process_port"),
    "mixed_precision: bare no": ({"mixed_precision": False}, "mixed_precision"),
    "mixed_precision: fp32": ({"mixed_precision": "fp32"}, "mixed_precision"),
    "use_cpu: 'yes'": ({"use_cpu": "yes"}, "use_cpu"),
    "deepspeed_config: hello": ({"deepspeed_config": "hello"}, "deepspeed_config"),
    "fsdp_config: [a]": ({"fsdp_config": ["a"]}, "fsdp_config"),
    "zero_stage: 5": ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 5}},
                      "deepspeed_config.zero_stage"),
    "zero_stage: two": ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": "two"}},
                        "deepspeed_config.zero_stage"),
    "gradient_accumulation_steps: 0": (
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"gradient_accumulation_steps": 0}},
        "deepspeed_config.gradient_accumulation_steps",
    ),
    "offload_optimizer_device: disk": (
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"offload_optimizer_device": "disk"}},
        "deepspeed_config.offload_optimizer_device",
    ),
    "fsdp_version: 3": ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 3}}, "fsdp_config.fsdp_version"),
    "fsdp_min_num_params: -5": ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_min_num_params": -5}},
                                "fsdp_config.fsdp_min_num_params"),
}


@pytest.mark.parametrize("case", sorted(YAML_CASES))
def test_accelerate_values_of_the_wrong_type_or_range_are_errors(case, tmp_path, monkeypatch, capsys):
    changes, key = YAML_CASES[case]
    code, payload = check_json(tmp_path, monkeypatch, capsys, merged(DDP_YAML, changes))
    found = [f for f in payload["findings"] if f["code"] == "accelerate-value-invalid"]
    assert [f["key"] for f in found] == [key], payload["findings"]
    assert code == 1


def test_accelerate_really_fails_on_a_deepspeed_config_that_is_not_a_mapping(tmp_path):
    """The finding is not a style opinion: accelerate's launch argument processing crashes on it."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    config = tmp_path / "acc.yaml"
    config.write_text(yaml.safe_dump(merged(DS_YAML, {"deepspeed_config": "hello"})))
    args = launch_command_parser().parse_args(["--config_file", str(config), str(tmp_path / "never_run.py")])
    with pytest.raises(AttributeError, match="'str' object has no attribute"):
        launch_command(args)


ACCELERATE_KEYS = [*DDP_YAML, "main_process_ip", "main_process_port", "deepspeed_config", "fsdp_config"]


@pytest.mark.parametrize("key", ACCELERATE_KEYS)
def test_any_kind_of_value_in_the_yaml_is_judged_never_a_crash(key, tmp_path, monkeypatch, capsys):
    ds = merged(ZERO3_JSON, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}})
    for value in WRONG_KINDS:
        code, _ = check_json(tmp_path, monkeypatch, capsys, merged(DS_YAML, {key: value}), ds)
        assert code in (0, 1), (key, value)


@pytest.mark.parametrize(("machines", "expected"), [(1, []), (2, ["accelerate-value-invalid"])])
def test_num_processes_auto_is_valid_on_one_machine(machines, expected, tmp_path, monkeypatch, capsys):
    """accelerate hands `num_processes: auto` to torchrun as --nproc_per_node auto (one process per GPU) on one machine
    (its own launch code runs here, nothing refuses it); with several it divides "auto" by num_machines and fails."""
    yaml_cfg = merged(DDP_YAML, {"num_processes": "auto", "num_machines": machines, "machine_rank": 0,
                                 "main_process_ip": "10.0.0.1" if machines > 1 else None})
    (tmp_path / "auto.yaml").write_text(yaml.safe_dump(yaml_cfg))
    inputs = check.load_inputs(str(tmp_path / "auto.yaml"), cwd=tmp_path)
    assert (inputs.launch_error is None) == (machines == 1)  # accelerate's own verdict
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg)
    assert codes(payload) == expected
    for finding in payload["findings"]:
        assert "one machine only" in finding["problem"]


def test_a_peer_tp_yamls_fsdp_settings_are_compared_with_what_train_py_runs(tmp_path, monkeypatch, capsys):
    """accelerate's tp_hsdp.yaml (tests/data/peer_configs), run without --hf_scale_config: train.py shards it with the
    fsdp settings read back through the generator's table. A value that table does not give back is one line each;
    one it does (reshard_after_forward false = shard_grad_op) and the public file as it is are silent."""
    public = yaml.safe_load((Path(__file__).parents[1] / "data" / "peer_configs" / "accelerate_tp_hsdp.yaml")
                            .read_text())
    _, payload = check_json(tmp_path, monkeypatch, capsys, public)
    assert "fsdp-setting-not-run" not in [f["code"] for f in payload["findings"]], payload
    edited = merged(public, {"fsdp_config": {"fsdp_state_dict_type": "LOCAL_STATE_DICT",
                                             "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                                             "fsdp_reshard_after_forward": False}})
    _, payload = check_json(tmp_path, monkeypatch, capsys, edited)
    lines = [(f["key"], f["problem"].split(":")[0]) for f in payload["findings"] if f["code"] == "fsdp-setting-not-run"]
    assert lines == [
        ("fsdp_config.fsdp_auto_wrap_policy",
         "`fsdp_config.fsdp_auto_wrap_policy`='SIZE_BASED_WRAP', but train.py runs fsdp_auto_wrap_policy="
         "'TRANSFORMER_BASED_WRAP'"),
        ("fsdp_config.fsdp_state_dict_type",
         "`fsdp_config.fsdp_state_dict_type`='LOCAL_STATE_DICT', but train.py runs fsdp_state_dict_type="
         "'SHARDED_STATE_DICT'"),
    ], payload
