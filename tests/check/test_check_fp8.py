"""`hf-scale check`, FP8 (hf_scale.check.fp8): fp8 combinations accelerate refuses at start (the config's own rule,
applied to hand-written YAMLs), and where fp8 is asked for but will be slower than bf16."""

from __future__ import annotations

import json

import pytest
from check_cases import (
    DDP_YAML,
    DS_JSON,
    DS_YAML,
    FSDP_YAML,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
)

pytest.importorskip("torchao")  # which layers are large enough is torchao's own filter

FP8_YAML = merged(DDP_YAML, {"mixed_precision": "fp8", "fp8_config": {"backend": "AO"}})
FP8_FSDP_OFFLOAD_YAML = merged(FP8_YAML, {"distributed_type": "FSDP", "fsdp_config": {
    "fsdp_version": 2, "fsdp_offload_params": True, "fsdp_cpu_ram_efficient_loading": False}})
FP8_FSDP_RAM_LOADING_YAML = merged(FSDP_YAML, {"mixed_precision": "fp8", "fp8_config": {"backend": "AO"}})
FP8_FSDP_UNWRITTEN_RAM_LOADING_YAML = merged(FP8_FSDP_RAM_LOADING_YAML,
                                             {"fsdp_config": {"fsdp_cpu_ram_efficient_loading": None}})
MSAMP_YAML = merged(FP8_YAML, {"fp8_config": {"backend": "MSAMP"}})
TE_YAML = merged(FP8_YAML, {"fp8_config": {"backend": "TE"}})

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
    "fp8-without-compile": (FP8_YAML, None, ["--bf16"], None, [], "fp8-no-compile", "warning"),
    "fp8-with-fsdp-offload": (FP8_FSDP_OFFLOAD_YAML, None, [], None, [], "fp8-offload", "warning"),
    "fp8-on-a-small-model": (FP8_YAML, None, ["--torch_compile"], None, [], "fp8-small-layers", "warning"),
    "torchao-fsdp-ram-efficient-loading": (FP8_FSDP_RAM_LOADING_YAML, None, [], None, [], "fp8-refused", "error"),
    "torchao-fsdp-ram-efficient-loading-unwritten": (FP8_FSDP_UNWRITTEN_RAM_LOADING_YAML, None, [], None, [],
                                                     "fp8-refused", "error"),
    "msamp-fsdp": (merged(MSAMP_YAML, {"distributed_type": "FSDP", "fsdp_config": FSDP_YAML["fsdp_config"]}), None,
                   [], None, [], "fp8-refused", "error"),
    "msamp-deepspeed": (merged(DS_YAML, {"mixed_precision": "fp8", "fp8_config": {"backend": "MSAMP"}}), DS_JSON,
                        [], None, [], "fp8-refused", "error"),
    # accelerate's FP8BackendType, TERecipeKwargs and MSAMPRecipeKwargs raise on these at start.
    "backend-not-accelerates": (merged(FP8_YAML, {"fp8_config": {"backend": "AOO"}}), None, [], None, [],
                                "fp8-value-invalid", "error"),
    "te-format-not-accelerates": (merged(TE_YAML, {"fp8_config": {"fp8_format": "E5M2X"}}), None, [], None, [],
                                  "fp8-value-invalid", "error"),
    "msamp-opt-level-not-accelerates": (merged(MSAMP_YAML, {"fp8_config": {"opt_level": "O9"}}), None, [], None, [],
                                        "fp8-value-invalid", "error"),
    "te-amax-history-negative": (merged(TE_YAML, {"fp8_config": {"amax_history_len": -5}}), None, [], None, [],
                                 "fp8-value-invalid", "error"),
    "te-amax-history-not-a-number": (merged(TE_YAML, {"fp8_config": {"amax_history_len": "long"}}), None, [], None,
                                     [], "fp8-value-invalid", "error"),
    # Keys accelerate launch exports and nothing reads: a stranger (warning), a misspelling (error), the one
    # `accelerate config` itself writes.
    "fp8-key-foreign": (merged(FP8_YAML, {"fp8_config": {"foo": 1}}), None, [], None, [], "fp8-key-unknown",
                        "warning"),
    "fp8-key-accelerate-configs-own-misspelling": (merged(TE_YAML, {"fp8_config": {"amax_history_length": 1024}}),
                                                   None, [], None, [], "fp8-key-unknown", "error"),
}


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)


def test_a_misspelled_fp8_key_is_named_with_the_key_accelerate_reads(tmp_path, monkeypatch, capsys):
    yaml_cfg = merged(TE_YAML, {"fp8_config": {"amax_history_length": 1024, "fp8_amax_compute_algorithm": "max"}})
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, train=["--bf16", "--torch_compile"])
    fixes = {f["key"]: f["fix"] for f in payload["findings"] if f["code"] == "fp8-key-unknown"}
    assert "rename `amax_history_length` to `amax_history_len`" in fixes["fp8_config.amax_history_length"]
    assert "to `fp8_amax_compute_algo`" in fixes["fp8_config.fp8_amax_compute_algorithm"]  # its fp8_ spelling kept


def test_valid_fp8_settings_in_every_spelling_accelerate_reads_are_clean(tmp_path, monkeypatch, capsys):
    """Values accelerate takes (TERecipeKwargs upper-cases the format, lower-cases the algorithm; YAML booleans;
    keys with or without the fp8_ prefix; accelerate's NO backend, which auto-detects) are not findings."""
    te = {"backend": "TE", "fp8_format": "hybrid", "amax_compute_algo": "MAX", "fp8_amax_history_len": 16,
          "margin": 0, "interval": 1, "use_autocast_during_eval": False, "use_mxfp8_block_scaling": "false",
          "override_linear_precision": [False, False, True]}
    for block in (te, {"backend": "MSAMP", "opt_level": "O1"}, {"backend": "NO"},
                  {"backend": "AO", "pad_inner_dim": True, "enable_fsdp_float8_all_gather": False}):
        _, payload = check_json(tmp_path, monkeypatch, capsys, merged(FP8_YAML, {"fp8_config": None}) | {
            "fp8_config": block}, train=["--bf16", "--torch_compile"])
        assert not [c for c in codes(payload) if c in ("fp8-value-invalid", "fp8-key-unknown")], (block, payload)


def test_an_fp8_block_without_fp8_training_is_not_judged_by_value(tmp_path, monkeypatch, capsys):
    """accelerate exports fp8_config only with mixed_precision fp8: under bf16 a bad value changes nothing."""
    yaml_cfg = merged(DDP_YAML, {"fp8_config": {"backend": "AOO"}})
    code, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, train=["--bf16"])
    assert code == 0 and "fp8-value-invalid" not in codes(payload)


def _llama_dir(tmp_path, hidden: int, intermediate: int):
    from transformers import LlamaConfig

    path = tmp_path / "model"
    LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000).save_pretrained(path)
    return str(path)


def test_fp8_with_the_embedded_small_model_and_no_compile_warns_twice(tmp_path, monkeypatch, capsys):
    code, payload = check_json(tmp_path, monkeypatch, capsys, FP8_YAML, train=["--bf16"])
    assert code == 0 and codes(payload) == ["fp8-no-compile", "fp8-small-layers"]
    assert all(f["severity"] == "warning" for f in payload["findings"])


def test_a_large_model_with_torch_compile_is_clean(tmp_path, monkeypatch, capsys):
    model = _llama_dir(tmp_path, 4096, 14336)
    code, payload = check_json(tmp_path, monkeypatch, capsys, FP8_YAML,
                               train=["--bf16", "--torch_compile", "--model_name_or_path", model])
    assert code == 0 and codes(payload) == []


def test_fp8_from_the_hf_scale_config_with_offload_warns(tmp_path, monkeypatch, capsys):
    (tmp_path / "cfg.yaml").write_text(
        "strategy: deepspeed\nprecision: fp8\ntopology: {processes_per_machine: 2}\n"
        "deepspeed: {zero_stage: 3, offload_params: cpu}\n")
    ds = merged(DS_JSON, {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    model = _llama_dir(tmp_path, 4096, 14336)
    code, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds,
                               train=["--hf_scale_config", "cfg.yaml", "--torch_compile", "--model_name_or_path",
                                      model])
    assert "fp8-offload" in codes(payload), json.dumps(payload)[:2000]
    assert "precision-mismatch" not in codes(payload)  # fp8 is DeepSpeed's bf16


def test_bf16_is_not_looked_at(tmp_path, monkeypatch, capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, DDP_YAML, train=["--bf16"])
    assert not [c for c in codes(payload) if c.startswith("fp8")]


@pytest.mark.parametrize(("yaml_cfg", "refused"), [
    (FP8_FSDP_RAM_LOADING_YAML, True),
    (merged(FP8_FSDP_RAM_LOADING_YAML, {"fsdp_config": {"fsdp_cpu_ram_efficient_loading": False}}), False),
    (merged(FP8_FSDP_RAM_LOADING_YAML, {"fp8_config": {"backend": "TE"}}), False),
    (merged(MSAMP_YAML, {"distributed_type": "FSDP", "fsdp_config": FSDP_YAML["fsdp_config"]}), True),
    (MSAMP_YAML, False),  # MS-AMP on DDP: accelerate runs it
    (FP8_YAML, False),
], ids=["ao-fsdp-ram", "ao-fsdp-no-ram", "te-fsdp-ram", "msamp-fsdp", "msamp-ddp", "ao-ddp"])
def test_a_yaml_is_refused_exactly_where_the_config_is(yaml_cfg, refused, tmp_path, monkeypatch, capsys):
    """The check and `hf-scale generate` ask the one rule (precision_rules.fp8_refusal): the same combination
    written as a DistributedConfig is refused exactly when the YAML is; the YAML's refusal is an error (exit 1)."""
    from hf_scale.config.distributed_config import validate_config
    from hf_scale.errors import UserError

    code, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, train=["--bf16", "--torch_compile"])
    assert ("fp8-refused" in codes(payload)) == refused and (code == 1) == refused, codes(payload)
    strategy = {"FSDP": "fsdp", "MULTI_GPU": "ddp"}[yaml_cfg["distributed_type"]]
    fsdp = yaml_cfg.get("fsdp_config", {})
    data = {"precision": "fp8", "strategy": strategy, "topology": {"processes_per_machine": 2},
            "fp8": {"backend": {"AO": "torchao", "TE": "te", "MSAMP": "msamp"}[yaml_cfg["fp8_config"]["backend"]]}}
    if strategy == "fsdp":
        data["fsdp"] = {"cpu_ram_efficient_loading": fsdp.get("fsdp_cpu_ram_efficient_loading", True)}
    try:
        validate_config(data)
    except UserError:
        assert refused
    else:
        assert not refused
