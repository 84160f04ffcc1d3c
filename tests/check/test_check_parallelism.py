"""`hf-scale check`, the YAML's `parallelism_config:` block (hf_scale.check.parallelism): unknown keys, sizes that are
no integers or do not multiply to num_processes, and the layout rules `hf-scale generate` enforces."""

from __future__ import annotations

import pytest
import yaml
from check_cases import (
    DDP_YAML,
    DS_JSON,
    DS_YAML,
    FSDP_YAML,
    REPO,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
)

from hf_scale.config.distributed_config import config_from_data
from hf_scale.generators.accelerate_yaml import accelerate_config


def block(**sizes) -> dict:
    return {"parallelism_config": {f"parallelism_config_{name}_size": size for name, size in sizes.items()}}


FSDP4 = merged(FSDP_YAML, {"num_processes": 4})

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "misspelled-size-key": (
        merged(FSDP4, {"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_tp_siz": 2}}),
        None, [], None, [], "parallelism-key-unknown", "error",
    ),
    "foreign-key": (
        merged(FSDP4, {"parallelism_config": {"parallelism_config_dp_shard_size": 4, "note": "x"}}),
        None, [], None, [], "parallelism-key-unknown", "warning",
    ),
    "size-not-an-integer": (
        merged(FSDP4, block(dp_shard=2, tp="2")), None, [], None, [], "parallelism-value-invalid", "error",
    ),
    # accelerate's ParallelismConfig / TorchContextParallelConfig refuse these when the processes start.
    "sp-backend-not-accelerates": (
        merged(DS_YAML, {"num_processes": 4, "parallelism_config": {
            "parallelism_config_dp_shard_size": 2, "parallelism_config_sp_size": 2,
            "parallelism_config_sp_backend": "megatron"}}), DS_JSON, [], None, [], "parallelism-value-invalid", "error",
    ),
    "cp-comm-strategy-not-accelerates": (
        merged(FSDP4, {"parallelism_config": {"parallelism_config_dp_shard_size": 2, "parallelism_config_cp_size": 2,
                                              "parallelism_config_cp_comm_strategy": "ring"}}),
        None, [], None, [], "parallelism-value-invalid", "error",
    ),
    "sizes-do-not-multiply-to-num-processes": (
        merged(FSDP4, block(dp_shard=4, tp=2)), None, [], None, [], "parallelism-size-mismatch", "error",
    ),
    "tp-with-zero": (
        merged(DS_YAML, block(dp_shard=1, tp=2)), DS_JSON, [], None, [], "parallelism-unsupported", "error",
    ),
    # A MULTI_GPU YAML sharding (train.py would run FSDP2 under tp), a DEEPSPEED one sizing replicas.
    "dp-shard-with-ddp": (
        merged(DDP_YAML, {"num_processes": 8, **block(dp_shard=4, tp=2)}), None, [], None, [],
        "parallelism-unsupported", "error",
    ),
    "dp-replicate-with-zero": (
        merged(DS_YAML, {"num_processes": 8, **block(dp_replicate=2, dp_shard=4)}), DS_JSON, [], None, [],
        "parallelism-unsupported", "error",
    ),
    "cp-with-ddp": (
        merged(DDP_YAML, block(cp=2)), None, [], None, [], "parallelism-unsupported", "error",
    ),
    # A DeepSpeed Ulysses block too (accelerate skips its own size check for it; train.py does not).
    "sp-sizes-do-not-multiply-to-num-processes": (
        merged(DS_YAML, {"num_processes": 4, **block(dp_shard=7, sp=2)}), DS_JSON, [], None, [],
        "parallelism-size-mismatch", "error",
    ),
    "sp-without-deepspeed": (
        merged(FSDP4, block(dp_shard=2, sp=2)), None, [], None, [], "parallelism-unsupported", "error",
    ),
    "cp-with-sp": (
        merged(DS_YAML, {"num_processes": 4, **block(cp=2, sp=2)}), DS_JSON, [], None, [], "parallelism-unsupported",
        "error",
    ),
    "hsdp-over-pure-replication-with-tp": (
        merged(FSDP4, block(dp_replicate=2, dp_shard=1, tp=2)), None, [], None, [], "parallelism-unsupported",
        "error",
    ),
    # train.py's refusals before the model loads, from the training args (the embedded model: 4 heads, 2 KV heads)
    "tp-not-dividing-the-key-value-heads": (
        merged(FSDP4, {"num_processes": 8, **block(dp_shard=2, tp=4)}), None, ["--output_dir", "out"], None, [],
        "parallelism-unsupported", "error",
    ),
    "cp-with-packing": (
        merged(FSDP4, block(dp_shard=2, cp=2)), None, ["--output_dir", "out", "--packing"], None, [],
        "parallelism-unsupported", "error",
    ),
    # (the same rule as train.py's start: hf_scale.contract.parallel_refusals.flag_refusal)
    "tp-with-lora": (
        merged(FSDP4, block(dp_shard=2, tp=2)), None, ["--output_dir", "out", "--lora_r", "4"], None, [],
        "parallelism-unsupported", "error",
    ),
    "sp-with-eager-attention": (
        merged(DS_YAML, {"num_processes": 4, **block(sp=2, dp_shard=2)}), DS_JSON,
        ["--output_dir", "out", "--attn_implementation", "eager"], None, [], "parallelism-unsupported", "error",
    ),
    "tp-across-machines": (
        merged(FSDP4, {"num_machines": 2, "main_process_ip": "10.0.0.1", **block(dp_shard=1, cp=1, tp=4)}),
        None, [], None, [], "parallelism-unsupported", "error",
    ),
    # accelerate's tp_hsdp.yaml with a state dict type train.py's fsdp settings under tp do not give back (more in
    # test_check_accelerate_yaml.test_a_peer_tp_yamls_fsdp_settings_are_compared_with_what_train_py_runs)
    "fsdp-setting-train-py-does-not-run": (
        merged(yaml.safe_load((REPO / "tests" / "data" / "peer_configs" / "accelerate_tp_hsdp.yaml").read_text()),
               {"fsdp_config": {"fsdp_state_dict_type": "LOCAL_STATE_DICT"}}),
        None, [], None, [], "fsdp-setting-not-run", "warning",
    ),
}


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize(
    "data",
    [
        {"strategy": "fsdp", "topology": {"processes_per_machine": 4}, "parallelism": {"tp": 2}},
        {"strategy": "fsdp", "topology": {"processes_per_machine": 4}, "parallelism": {"cp": 2}},
        {"strategy": "ddp", "topology": {"processes_per_machine": 2}, "parallelism": {"tp": 2}},
    ],
    ids=["fsdp2_tp", "fsdp2_cp", "pure_tp"],
)
def test_what_generate_writes_passes_check(data, tmp_path, monkeypatch, capsys):
    """The same rules: a layout generate accepts has no parallelism finding in check."""
    yaml_cfg = accelerate_config(config_from_data(data), deepspeed_config_file=None)
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg)
    assert not [code for code in codes(payload) if code.startswith("parallelism")]


def _problems(payload, code="parallelism-unsupported") -> list[str]:
    return [f["problem"] for f in payload["findings"] if f["code"] == code]


def test_heads_and_cp_flags_are_train_pys_refusals_from_the_yaml_or_the_hf_scale_config(tmp_path, monkeypatch,
                                                                                          capsys):
    yaml_cfg, _, train, *_ = TRIGGERS["tp-not-dividing-the-key-value-heads"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, None, train)
    assert _problems(payload) == [
        "parallelism_config.tp=4 does not divide the model's num_key_value_heads=2: each rank must hold whole heads; "
        "allowed tp: 1, 2 (train.py stops on it before the model loads)."]
    _, payload = check_json(tmp_path, monkeypatch, capsys, *TRIGGERS["cp-with-packing"][:3])
    assert any("cp=2 with --packing: ring attention takes no document mask" in p for p in _problems(payload))
    # The layout of --hf_scale_config (no parallelism_config block in the YAML), and no finding without training args
    (tmp_path / "sp.yaml").write_text("strategy: deepspeed\ntopology: {processes_per_machine: 4}\n"
                                      "parallelism: {sp: 4}\n")
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(DS_YAML, {"num_processes": 4}), DS_JSON,
                            ["--output_dir", "out", "--hf_scale_config", "sp.yaml"])
    found = [f for f in payload["findings"] if f["code"] == "parallelism-unsupported"]
    assert [(f["file"], f["key"]) for f in found] == [("sp.yaml", "parallelism")]
    assert "parallelism.sp=4 does not divide the model's num_key_value_heads=2" in found[0]["problem"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg)
    assert not _problems(payload)


def test_tp_with_lora_and_sp_with_eager_are_train_pys_refusals_in_its_words(tmp_path, monkeypatch, capsys):
    """`check tp2.yaml -- --lora_r 4` and `check sp2.yaml -- --attn_implementation eager` said ok, then train.py
    refused at start: now the same function says it in both."""
    _, payload = check_json(tmp_path, monkeypatch, capsys, *TRIGGERS["tp-with-lora"][:3])
    assert _problems(payload) == [
        "--lora_r=4 with tensor parallelism (parallelism_config.tp=2): hf_scale has not proven peft's LoRA layers on "
        "DTensor weights; train all weights (--lora_r 0) or set parallelism.tp to 1 (train.py stops on it before the "
        "model loads)."]
    (tmp_path / "sp.yaml").write_text("strategy: deepspeed\ntopology: {processes_per_machine: 4}\n"
                                      "parallelism: {sp: 2}\n")
    _, payload = check_json(tmp_path, monkeypatch, capsys, merged(DS_YAML, {"num_processes": 4}), DS_JSON,
                            ["--output_dir", "out", "--hf_scale_config", "sp.yaml", "--attn_implementation", "eager"])
    assert _problems(payload) == [
        "parallelism.sp=2 with --attn_implementation=eager: Ulysses runs here around sdpa; use --attn_implementation "
        "sdpa (or auto) (train.py stops on it before the model loads)."]
