"""`hf-scale check` on mixture-of-experts files (hf_scale.check.moe): DeepSpeed's AutoEP section (what hf_scale has
not proven), an autoep_size that does not divide the world or the model's experts, an expert_tensor_parallel_size
DeepSpeed refuses, a section that is not enabled, an accelerate `parallelism_config_ep_size` (no such option), and an
hf_scale config whose parallelism.ep the model's experts rule out (train.py's own rule)."""

from __future__ import annotations

import json
import shutil

import pytest
from check_cases import (
    DATA,
    DS_JSON,
    DS_YAML,
    FSDP_YAML,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
)
from transformers import Qwen3MoeConfig

AUTOEP = json.loads((DATA / "moe" / "autoep_mixtral_zero2.json").read_text())
SIX = merged(DS_YAML, {"num_processes": 6})
EIGHT = merged(DS_YAML, {"num_processes": 8})


@pytest.fixture(autouse=True)
def moe_models(tmp_path):
    """Two local MoE model configs (6 and 8 routed experts) where the training args point, as a user's model dir."""
    for experts in (6, 8):
        Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=experts,
                       num_experts_per_tok=2, vocab_size=128).save_pretrained(tmp_path / f"moe{experts}")


def train(model: str = "moe8", *more: str) -> list[str]:
    return ["--output_dir", "out", "--model_name_or_path", model, *more]


# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "autoep-enabled": (EIGHT, AUTOEP, train(), None, [], "moe-deepspeed-autoep", "warning"),
    "autoep-size-not-dividing-the-world": (SIX, merged(AUTOEP, {"expert_parallel": {"autoep_size": 4}}), [], None,
                                           [], "moe-ep-size", "error"),
    "autoep-size-not-dividing-the-experts": (EIGHT, AUTOEP, train("moe6"), None, [], "moe-ep-size", "error"),
    "autoep-expert-tensor-parallel": (EIGHT, merged(AUTOEP, {"expert_parallel": {"expert_tensor_parallel_size": 2}}),
                                      [], None, [], "moe-ep-size", "error"),
    "autoep-size-without-enabled": (EIGHT, merged(AUTOEP, {"expert_parallel": {"enabled": False}}), [], None, [],
                                    "moe-ep-ignored", "warning"),
    "accelerate-ep-size": (merged(FSDP_YAML, {"num_processes": 4, "parallelism_config": {
        "parallelism_config_dp_shard_size": 4, "parallelism_config_ep_size": 2}}), None, [], None, [],
        "moe-accelerate-ep", "error"),
}


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_moe_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_moe_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)


def test_the_documented_autoep_block_on_8_gpus_and_8_experts_is_only_the_not_proven_warning(tmp_path, monkeypatch,
                                                                                               capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, EIGHT, AUTOEP, train())
    assert [f for f in codes(payload) if f.startswith("moe-")] == ["moe-deepspeed-autoep"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, SIX, AUTOEP, train("moe6"))
    problems = [f["problem"] for f in payload["findings"] if f["code"] == "moe-ep-size"]
    assert problems == [
        "autoep_size=4 does not divide the world size 6: DeepSpeed's folding needs whole expert-parallel groups "
        "(\"Computed edp would be non-integral\").",
        "autoep_size=4 does not divide the model's 6 routed experts: each rank must hold whole experts (DeepSpeed "
        "raises when it replaces the layers).",
    ]


def test_a_json_without_an_expert_parallel_section_has_no_moe_finding(tmp_path, monkeypatch, capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, EIGHT, DS_JSON, train())
    assert not [c for c in codes(payload) if c.startswith("moe-")]


def test_an_hf_scale_config_ep_that_the_experts_rule_out_is_train_pys_refusal(tmp_path, monkeypatch, capsys):
    """parallelism.ep=4 on the 6-expert model: the finding is train.py's own line (it stops there before loading)."""
    config = tmp_path / "ep.yaml"
    config.write_text("strategy: fsdp\ntopology: {processes_per_machine: 4}\nparallelism: {ep: 4}\n")
    yaml_cfg = merged(FSDP_YAML, {"num_processes": 4})
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, None,
                            train("moe6", "--hf_scale_config", str(config)))
    (finding,) = [f for f in payload["findings"] if f["code"] == "parallelism-unsupported"]
    assert finding["problem"].startswith("parallelism.ep=4 does not divide the model's 6 routed experts: each rank "
                                         "holds whole experts; allowed ep: 1, 2, 3, 6")
    shutil.rmtree(tmp_path / "moe6")
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, None,
                            train("moe8", "--hf_scale_config", str(config)))
    assert "parallelism-unsupported" not in codes(payload)
