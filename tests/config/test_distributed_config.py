"""DistributedConfig: defaults, the batch arithmetic, cross-field rules, loading and one-line errors."""

from __future__ import annotations

import json

import pytest

from hf_scale.config.distributed_config import (
    DistributedConfig,
    config_from_data,
    config_warnings,
    load_config,
    validate_config,
)
from hf_scale.config.presets import load_preset
from hf_scale.errors import UserError


def error_of(data) -> str:
    with pytest.raises(UserError) as caught:
        validate_config(data)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_defaults_are_valid_and_fill_the_batch():
    cfg = DistributedConfig()
    assert cfg.world_size == 1
    assert (
        cfg.batch.global_batch_size,
        cfg.batch.micro_batch_size,
        cfg.batch.gradient_accumulation_steps,
    ) == (1, 1, 1)


def test_world_size_is_machines_times_processes_per_machine():
    cfg = validate_config(
        {
            "strategy": "ddp",
            "topology": {"num_machines": 3, "processes_per_machine": 4, "main_process_ip": "h"},
        }
    )
    assert cfg.world_size == 12


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ({}, (8, 1, 1)),
        ({"micro_batch_size": 4}, (32, 4, 1)),
        ({"gradient_accumulation_steps": 2}, (16, 1, 2)),
        ({"micro_batch_size": 2, "gradient_accumulation_steps": 3}, (48, 2, 3)),
        ({"global_batch_size": 64}, (64, 1, 8)),
        ({"global_batch_size": 64, "micro_batch_size": 4}, (64, 4, 2)),
        ({"global_batch_size": 64, "gradient_accumulation_steps": 4}, (64, 2, 4)),
        ({"global_batch_size": 64, "micro_batch_size": 2, "gradient_accumulation_steps": 4}, (64, 2, 4)),
    ],
)
def test_any_two_batch_values_determine_the_third(batch, expected):
    cfg = validate_config({"strategy": "ddp", "topology": {"processes_per_machine": 8}, "batch": batch})
    assert (
        cfg.batch.global_batch_size,
        cfg.batch.micro_batch_size,
        cfg.batch.gradient_accumulation_steps,
    ) == expected


def test_an_indivisible_global_batch_shows_the_arithmetic():
    message = error_of(
        {
            "strategy": "ddp",
            "topology": {"processes_per_machine": 8},
            "batch": {"global_batch_size": 30, "micro_batch_size": 4},
        }
    )
    assert message.startswith(
        "batch.global_batch_size=30 is not micro_batch_size(4) x "
        "gradient_accumulation_steps(?) x world_size(8) = 32 x k"
    )


def test_an_inconsistent_batch_triple_shows_the_product():
    message = error_of(
        {
            "strategy": "ddp",
            "topology": {"processes_per_machine": 8},
            "batch": {"global_batch_size": 60, "micro_batch_size": 4, "gradient_accumulation_steps": 2},
        }
    )
    assert "x world_size(8) = 64" in message


def test_validated_config_round_trips_through_its_own_dump():
    cfg = validate_config(
        {
            "strategy": "deepspeed",
            "topology": {"processes_per_machine": 4},
            "batch": {"global_batch_size": 32},
        }
    )
    assert validate_config(cfg.model_dump()) == cfg


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"bf16": True}, "bf16"),
        ({"fp16": True}, "fp16"),
        ({"fp16": True, "precision": "fp16"}, "fp16"),
        ({"bf16": False, "precision": "no"}, "no"),
    ],
)
def test_legacy_precision_shorthands(data, expected):
    assert validate_config(data).precision == expected


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"strategy": "deepspeed", "deepspeed": {"zero_stage": 4}}, "deepspeed.zero_stage=4"),
        (
            {"strategy": "deepspeed", "deepspeed": {"offload_params": "cpu"}},
            "deepspeed.offload_params=cpu needs",
        ),
        (
            {"strategy": "deepspeed", "deepspeed": {"zero_stage": 0, "offload_optimizer": "cpu"}},
            "deepspeed.offload_optimizer=cpu needs",
        ),
        (
            {
                "strategy": "deepspeed",
                "deepspeed": {"zero_stage": 2, "offload_optimizer": "nvme", "nvme_path": "/n"},
            },
            "deepspeed.offload_optimizer=nvme needs deepspeed.zero_stage=3",
        ),
        (
            {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3, "offload_params": "nvme"}},
            "deepspeed.nvme_path is required",
        ),
        ({"bf16": True, "fp16": True}, "bf16=true and fp16=true"),
        ({"fp16": True, "precision": "bf16"}, "fp16=true disagrees with precision='bf16'"),
        ({"bf16": "yes please"}, "bf16='yes please' is invalid"),
        (
            {
                "strategy": "fsdp",
                "fsdp": {"sharding": "hybrid_shard"},
                "topology": {"processes_per_machine": 8},
            },
            "fsdp.sharding=hybrid_shard needs topology.num_machines >= 2",
        ),
        ({"strategy": "fsdp", "fsdp": {"sharding": "no_shard"}}, "fsdp.sharding=no_shard"),
        (
            {
                "strategy": "fsdp",
                "activation_checkpointing": True,
                "fsdp": {"activation_checkpointing": True},
            },
            "fsdp.activation_checkpointing=true and activation_checkpointing=true",
        ),
        ({"topology": {"processes_per_machine": 0}}, "topology.processes_per_machine=0"),
        ({"topology": {"main_process_port": 0}}, "topology.main_process_port=0"),
        ({"topology": {"main_process_port": 65536}}, "topology.main_process_port=65536"),
        (
            {"topology": {"machine_rank": 2, "num_machines": 2, "main_process_ip": "h"}, "strategy": "ddp"},
            "topology.machine_rank=2 is out of range",
        ),
        ({"strategy": "ddp", "topology": {"num_machines": 2}}, "topology.main_process_ip is required"),
        (
            {"strategy": "single", "topology": {"processes_per_machine": 2}},
            "strategy=single runs one process",
        ),
        ({"strategy": "deepspeed", "deepspeed": {"zero_stagee": 3}}, "did you mean deepspeed.zero_stage?"),
        ({"optimizer": {"betas": [0.9, 1.5]}}, "optimizer.betas[1]=1.5"),
        ({"deepspeed": {"reduce_bucket_size": "big"}}, 'must be "auto" or an integer from 1 to'),
    ],
)
def test_invalid_configs_name_the_field_in_one_line(data, fragment):
    assert fragment in error_of(data)


def test_deepspeed_only_fields_are_ignored_for_other_strategies():
    cfg = validate_config(
        {
            "strategy": "ddp",
            "topology": {"processes_per_machine": 2},
            "deepspeed": {"zero_stage": 0, "offload_params": "nvme"},
        }
    )
    assert cfg.strategy == "ddp"


def test_warnings_for_risky_but_legal_choices():
    fp16_offload = validate_config(
        {
            "strategy": "deepspeed",
            "precision": "fp16",
            "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu"},
        }
    )
    assert any("fp16 with ZeRO-3 offload" in warning for warning in config_warnings(fp16_offload))
    no_gather = validate_config(
        {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3, "gather_16bit_weights_on_save": False}}
    )
    assert any("final step's sharded DeepSpeed checkpoint" in warning and "hf-scale export" in warning
               for warning in config_warnings(no_gather))
    assert config_warnings(validate_config({"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}})) == []


def test_load_config_reads_yaml_and_applies_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "strategy: deepspeed\ntopology:\n  processes_per_machine: 4\ndeepspeed:\n  zero_stage: 2\n"
    )
    cfg = load_config(
        path,
        overrides=[
            "deepspeed.offload_optimizer=cpu",
            "optimizer.betas=[0.9, 0.95]",
            "batch.global_batch_size=32",
            "optimizer.lr=3e-4",
        ],
    )
    assert cfg.deepspeed.offload_optimizer == "cpu"
    assert cfg.optimizer.betas == (0.9, 0.95)
    assert cfg.optimizer.lr == 3e-4
    assert cfg.batch.gradient_accumulation_steps == 8


def test_config_from_data_applies_overrides_on_top_and_leaves_the_data_as_it_is():
    """What `generate --strategy auto` builds from the planner's data (no round trip through --set strings)."""
    data = {"strategy": "deepspeed", "topology": {"processes_per_machine": 2}, "batch": {"micro_batch_size": 2},
            "deepspeed": {"zero_stage": 2, "offload_optimizer": "none"}}
    before = json.dumps(data, sort_keys=True)
    cfg = config_from_data(data, ["deepspeed.offload_optimizer=cpu", "batch.gradient_accumulation_steps=4"])
    assert (cfg.deepspeed.offload_optimizer, cfg.batch.global_batch_size) == ("cpu", 16)
    assert json.dumps(data, sort_keys=True) == before
    assert config_from_data(data) == load_config(overrides=[f"{k}={json.dumps(v)}" for k, v in [
        ("strategy", "deepspeed"), ("topology", {"processes_per_machine": 2}), ("batch", {"micro_batch_size": 2}),
        ("deepspeed", {"zero_stage": 2, "offload_optimizer": "none"})]])


def test_overrides_re_derive_the_batch_of_a_preset():
    cfg = load_preset("zero2", overrides=["topology.processes_per_machine=2", "batch.global_batch_size=16"])
    assert (cfg.world_size, cfg.batch.gradient_accumulation_steps) == (2, 8)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("strategy: [unclosed\n", "not valid YAML at line"),
        ("- a\n- b\n", "the top level must be a mapping"),
        ("strategy: ddp\nbogus: 1\n", "unknown key bogus"),
    ],
)
def test_bad_yaml_files_give_one_line(tmp_path, content, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(UserError, match=fragment):
        load_config(path)


def test_empty_file_means_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == DistributedConfig()


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("novalue", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("deepspeed..zero_stage=3", "expected KEY=VALUE"),
        ("strategy.sub=1", "strategy is a value"),
        ("optimizer.betas=[0.9", "not valid YAML"),
    ],
)
def test_bad_overrides_give_one_line(override, fragment):
    with pytest.raises(UserError, match=fragment):
        load_preset("ddp", overrides=[override])


def test_a_missing_file_is_an_error(tmp_path):
    # A file and --preset together: tests/commands/test_generate.py (the command refuses the pair).
    with pytest.raises(UserError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_json_schema_documents_every_field():
    schema = DistributedConfig.model_json_schema()
    assert schema["additionalProperties"] is False
    sections = [schema, *schema["$defs"].values()]
    for section in sections:
        for name, prop in section["properties"].items():
            if "$ref" not in prop:
                assert prop.get("description"), name
    assert json.loads(json.dumps(schema)) == schema


def test_bare_yaml_no_means_precision_no(tmp_path):
    # YAML 1.1 reads `no` as false; for precision it must still mean "no".
    path = tmp_path / "run.yaml"
    path.write_text("strategy: single\nprecision: no\n")
    assert load_config(path).precision == "no"
    assert load_preset("ddp", overrides=["precision=no"]).precision == "no"
