"""`hf-scale check`, processes and machines (hf_scale.check.topology): CPU, GPUs per machine, multi-node."""

from __future__ import annotations

import pytest
import yaml
from check_cases import (
    DDP_YAML,
    FSDP_YAML,
    MULTINODE_YAML,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
)

from hf_scale.commands import check

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
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
    "fsdp-with-use-cpu": (
        merged(FSDP_YAML, {"use_cpu": True, "num_processes": 1}),
        None,
        [],
        None,
        [],
        "use-cpu-ignores-plugin",
        "error",
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
    "processes-beyond-any-machine": (
        merged(MULTINODE_YAML, {"num_processes": 1_000_000_000}),
        None,
        [],
        None,
        [],
        "processes-implausible",
        "error",
    ),
    "fsdp-sharded-final-save": (
        merged(FSDP_YAML, {"fsdp_config": {"fsdp_state_dict_type": "SHARDED_STATE_DICT"}}),
        None,
        [],
        None,
        [],
        "fsdp-sharded-final-save",
        "warning",
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
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)



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


def test_fsdp_gpu_warning_depends_on_the_target_gpu_count(tmp_path):
    (tmp_path / "fsdp.yaml").write_text(yaml.safe_dump(FSDP_YAML))
    for gpus, expected in ((None, []), (0, ["fsdp-no-gpu"]), (8, [])):
        inputs = check.load_inputs(str(tmp_path / "fsdp.yaml"), gpus_per_machine=gpus, cwd=tmp_path)
        assert [f.code for f in check.run_checks(inputs)] == expected


@pytest.mark.parametrize(
    ("rank", "expected"),
    [("1", []), (1, []), ("0", []), (2, ["machine-rank-out-of-range"]), ("one", ["accelerate-launch-fails"])],
)
def test_machine_rank_is_read_the_way_accelerate_launch_reads_it(rank, expected, tmp_path, monkeypatch, capsys):
    """accelerate int()s machine_rank when it launches: a quoted "1" is rank 1, "one" fails in accelerate."""
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(MULTINODE_YAML, {"machine_rank": rank}))
    assert codes(payload) == expected


@pytest.mark.parametrize(
    ("fsdp", "train", "expected"),
    [
        ({"fsdp_state_dict_type": "SHARDED_STATE_DICT"}, [], ["fsdp-sharded-final-save"]),
        ({"fsdp_state_dict_type": "SHARDED_STATE_DICT"}, ["--bf16"], []),
        ({"fsdp_state_dict_type": "SHARDED_STATE_DICT"}, ["--bf16", "--loop", "accelerate"], []),
        ({"fsdp_state_dict_type": "FULL_STATE_DICT"}, [], []),
        ({"fsdp_state_dict_type": None, "fsdp_version": 2}, [], ["fsdp-sharded-final-save"]),
        ({"fsdp_state_dict_type": None, "fsdp_version": 1}, [], []),
    ],
    ids=["sharded", "sharded-train-py-trainer", "sharded-train-py-manual-loop", "full", "fsdp2-default",
         "fsdp1-default"],
)
def test_fsdp_final_save_follows_the_state_dict_type_accelerate_uses(fsdp, train, expected, tmp_path, monkeypatch,
                                                                      capsys):
    """transformers' Trainer.save_model writes weights under FSDP only for FULL_STATE_DICT; the type is the one
    accelerate's plugin takes (FSDP_STATE_DICT_TYPE from `accelerate launch`, else FULL for FSDP1, SHARDED for FSDP2).
    A manual loop saves through accelerator.get_state_dict, which gathers whatever the type, and so does train.py's
    Trainer loop (HfScaleTrainer.save_model): with train.py's flags there is nothing to warn about."""
    import inspect

    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import Trainer

    assert 'if "FULL_STATE_DICT" in str(self.accelerator.state.fsdp_plugin.state_dict_type)' in inspect.getsource(
        Trainer.save_model)
    assert '"FULL_STATE_DICT" if self.fsdp_version == 1 else "SHARDED_STATE_DICT"' in inspect.getsource(
        FullyShardedDataParallelPlugin.set_state_dict_type)
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(FSDP_YAML, {"fsdp_config": fsdp}), train=train)
    assert codes(payload) == expected
    for finding in payload["findings"]:
        assert "FULL_STATE_DICT" in finding["fix"] and "hf-scale export" in finding["fix"]


@pytest.mark.parametrize(
    ("acc", "expected"),
    [
        ({"num_processes": 1_000_000_000, "num_machines": 1}, ["processes-implausible"]),
        ({"num_processes": 2048, "num_machines": 2}, []),  # 1024 per machine: hf_scale's own bound
        ({"num_processes": 4096, "num_machines": 2}, ["processes-implausible"]),
        ({"num_processes": 8, "num_machines": 100_000}, ["processes-implausible"]),
    ],
)
def test_absurd_process_counts_are_refused_with_what_is_allowed(acc, expected, tmp_path, monkeypatch, capsys):
    from hf_scale.config.distributed_config import MAX_MACHINES, MAX_PROCESSES_PER_MACHINE

    yaml_cfg = merged(MULTINODE_YAML, acc)
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg)
    found = [f for f in payload["findings"] if f["code"] == "processes-implausible"]
    assert [f["code"] for f in found] == expected
    for finding in found:
        assert f"1..{MAX_PROCESSES_PER_MACHINE}" in finding["problem"] or f"1..{MAX_MACHINES}" in finding["problem"]
