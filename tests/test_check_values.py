"""`hf-scale check` on values of the wrong type or range: what accelerate copies through and DeepSpeed's
parser never sees (the sample values hide the batch sizes) must be findings, never "ok"; files that are
not strict JSON/YAML are bad input (one line, exit 2)."""

from __future__ import annotations

import pytest
import yaml
from test_check import DDP_YAML, DS_JSON, DS_YAML, ZERO3_JSON, check_json, merged, run_cli

from hf_scale import check

YAML_CASES = {
    "num_processes: two": ({"num_processes": "two"}, "num_processes"),
    "num_processes: 0": ({"num_processes": 0}, "num_processes"),
    "num_processes: true": ({"num_processes": True}, "num_processes"),
    "num_processes: 2.5": ({"num_processes": 2.5}, "num_processes"),
    "num_machines: -1": ({"num_machines": -1}, "num_machines"),
    "machine_rank: x": ({"machine_rank": "x"}, "machine_rank"),
    "main_process_port: 70000": ({"main_process_port": 70000}, "main_process_port"),
    "main_process_port: '29500'": ({"main_process_port": "29500"}, "main_process_port"),
    "main_process_ip: $(reboot)": ({"main_process_ip": "$(reboot)"}, "main_process_ip"),
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
    "gradient_clipping: .inf": (
        {"distributed_type": "DEEPSPEED", "deepspeed_config": {"gradient_clipping": float("inf")}},
        "deepspeed_config.gradient_clipping",
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


JSON_CASES = {
    "negative micro batch": ({"train_micro_batch_size_per_gpu": -1}, "train_micro_batch_size_per_gpu"),
    "zero train batch": ({"train_batch_size": 0}, "train_batch_size"),
    "accumulation as a string": ({"gradient_accumulation_steps": "4"}, "gradient_accumulation_steps"),
    "accumulation true": ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps"),
    "negative clipping": ({"gradient_clipping": -1.0}, "gradient_clipping"),
    "lr as a word": ({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}}, "optimizer.params.lr"),
    "beta of 1": ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, "optimizer.params.betas"),
    "bf16 enabled 'yes'": ({"bf16": {"enabled": "yes"}}, "bf16.enabled"),
    "fp16 hysteresis 0": ({"bf16": {"enabled": False}, "fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),
    "optimizer a word": ({"optimizer": "adam"}, "optimizer"),
    "optimizer params a list": ({"optimizer": {"type": "AdamW", "params": [1]}}, "optimizer.params"),
    "optimizer type a number": ({"optimizer": {"type": 5, "params": {}}}, "optimizer.type"),
    "zero_optimization a number": ({"zero_optimization": 2}, "zero_optimization"),
}


@pytest.mark.parametrize("case", sorted(JSON_CASES))
def test_deepspeed_values_of_the_wrong_type_or_range_are_errors(case, tmp_path, monkeypatch, capsys):
    changes, path = JSON_CASES[case]
    code, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(DS_JSON, changes))
    found = [f for f in payload["findings"] if f["code"] == "deepspeed-value-invalid"]
    assert [f["key"] for f in found] == [path], payload["findings"]
    assert code == 1


@pytest.mark.parametrize("ds", [DS_JSON, ZERO3_JSON], ids=["zero2", "zero3"])
def test_valid_values_raise_no_value_finding(ds, tmp_path, monkeypatch, capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    assert not [f for f in payload["findings"] if f["code"].endswith("value-invalid")]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"train_batch_size": 8, "gradient_clipping": 1e999}', "gradient_clipping=1e999 is not a finite number"),
        ('{"optimizer": {"params": {"lr": NaN}}}', "optimizer.params.lr=NaN is not a finite number"),
        ('{"gradient_clipping": Infinity}', "gradient_clipping=Infinity is not a finite number"),
        ('{"train_batch_size": 8, "train_batch_size": 16}', "duplicate key 'train_batch_size'"),
        (b'{"a": "\xff"}', "not UTF-8 text (byte 0xff at line 1)"),
    ],
)
def test_json_that_is_not_strict_json_is_bad_input(text, fragment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(DS_YAML))
    data = text if isinstance(text, bytes) else text.encode()
    (tmp_path / "ds.json").write_bytes(data)
    code, out, err = run_cli(["check", "--accelerate-config", "acc.yaml"], capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and fragment in err, err


def test_the_offload_devices_and_stages_are_deepspeeds():
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    assert {e.value for e in OffloadDeviceEnum} == set(check.OFFLOAD_DEVICES)
    assert {int(e) for e in ZeroStageEnum if int(e) <= 3} == set(check.ZERO_STAGES)


def test_accelerate_really_fails_on_a_deepspeed_config_that_is_not_a_mapping(tmp_path):
    """The finding is not a style opinion: accelerate's launch argument processing crashes on it."""
    from accelerate.commands.launch import launch_command, launch_command_parser

    config = tmp_path / "acc.yaml"
    config.write_text(yaml.safe_dump(merged(DS_YAML, {"deepspeed_config": "hello"})))
    args = launch_command_parser().parse_args(["--config_file", str(config), str(tmp_path / "never_run.py")])
    with pytest.raises(AttributeError, match="'str' object has no attribute"):
        launch_command(args)


WRONG_KINDS = ["a word", 7, -1, True, [1], {"a": 1}, 1.5, ""]
ACCELERATE_KEYS = [*DDP_YAML, "main_process_ip", "main_process_port", "deepspeed_config", "fsdp_config"]
DEEPSPEED_PATHS = ["train_batch_size", "gradient_clipping", "bf16", "bf16.enabled", "optimizer", "optimizer.type",
                   "optimizer.params", "optimizer.params.lr", "optimizer.params.betas", "zero_optimization",
                   "zero_optimization.stage", "zero_optimization.offload_optimizer"]


def _set(data: dict, path: str, value) -> dict:
    data = merged(data, {})
    node = data
    *parents, leaf = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


@pytest.mark.parametrize("key", ACCELERATE_KEYS)
def test_any_kind_of_value_in_the_yaml_is_judged_never_a_crash(key, tmp_path, monkeypatch, capsys):
    ds = merged(ZERO3_JSON, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}})
    for value in WRONG_KINDS:
        code, _ = check_json(tmp_path, monkeypatch, capsys, merged(DS_YAML, {key: value}), ds)
        assert code in (0, 1), (key, value)


@pytest.mark.parametrize("path", DEEPSPEED_PATHS)
def test_any_kind_of_value_in_the_json_is_judged_never_a_crash(path, tmp_path, monkeypatch, capsys):
    for value in WRONG_KINDS:  # some are valid in some places: what matters is a verdict, not a traceback
        code, _ = check_json(tmp_path, monkeypatch, capsys, DS_YAML, _set(ZERO3_JSON, path, value))
        assert code in (0, 1), (path, value)
