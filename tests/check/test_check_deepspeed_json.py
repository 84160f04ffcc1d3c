"""`hf-scale check`, the DeepSpeed JSON on its own (hf_scale.check.deepspeed_json): "auto" values, keys and
values DeepSpeed refuses or never reads, values of the wrong type or range."""

from __future__ import annotations

import pytest
from check_cases import (
    DS_JSON,
    DS_YAML,
    WRONG_KINDS,
    ZERO3_JSON,
    _set,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    merged,
)

from hf_scale.knowledge import library_tables

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
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
    "negative-micro-batch": (DS_YAML, merged(DS_JSON, {"train_micro_batch_size_per_gpu": -2}), [], None, [],
                             "deepspeed-value-invalid", "error"),
    "removed-key": (DS_YAML, merged(DS_JSON, {"elasticity": {"enabled": False}}), [], None, [],
                    "deepspeed-key-removed", "error"),
    "warmup-zero": (DS_YAML, merged(DS_JSON, {"scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_steps": 0, "total_num_steps": "auto", "warmup_max_lr": "auto", "warmup_type": "linear"}}}), [],
        None, [], "deepspeed-warmup-refused", "error"),
}

@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_each_check_reports_its_problem(case, tmp_path, monkeypatch, capsys):
    assert_reports_its_problem(TRIGGERS[case], tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", sorted(TRIGGERS))
def test_every_fix_names_the_file_and_key_that_hold_the_value(case, tmp_path, monkeypatch, capsys):
    assert_every_fix_names_where_the_value_is(TRIGGERS[case], tmp_path, monkeypatch, capsys)



def test_each_unresolvable_auto_key_is_listed(tmp_path, monkeypatch, capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ZERO3_JSON, runner="accelerate")
    keys = sorted(f["key"] for f in payload["findings"] if f["code"] == "auto-unresolvable")
    assert keys == ["optimizer.params.betas", "optimizer.params.eps"]


def test_raw_deepspeed_runner_resolves_no_auto(tmp_path, monkeypatch, capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, DS_JSON, runner="deepspeed")
    keys = {f["key"] for f in payload["findings"] if f["code"] == "auto-unresolvable"}
    assert keys == set(library_tables.auto_paths(DS_JSON))


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


DEEPSPEED_PATHS = ["train_batch_size", "gradient_clipping", "bf16", "bf16.enabled", "optimizer", "optimizer.type",
                   "optimizer.params", "optimizer.params.lr", "optimizer.params.betas", "zero_optimization",
                   "zero_optimization.stage", "zero_optimization.offload_optimizer"]


@pytest.mark.parametrize("path", DEEPSPEED_PATHS)
def test_any_kind_of_value_in_the_json_is_judged_never_a_crash(path, tmp_path, monkeypatch, capsys):
    for value in WRONG_KINDS:  # some are valid in some places: what matters is a verdict, not a traceback
        code, _ = check_json(tmp_path, monkeypatch, capsys, DS_YAML, _set(ZERO3_JSON, path, value))
        assert code in (0, 1), (path, value)


@pytest.mark.parametrize(("stage", "refused"), [(2, False), (3, False), (0, True)])
def test_a_section_is_judged_beside_the_zero_section_deepspeed_reads_with_it(stage, refused, tmp_path, monkeypatch,
                                                                              capsys):
    """fp16 master weights need ZeRO 1-3 (DeepSpeedConfig._do_error_check reads zero_optimization while judging fp16):
    the fp16 block is parsed beside the file's zero_optimization, so only what DeepSpeed itself refuses is reported."""
    from deepspeed.runtime.config import DeepSpeedConfig

    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
          "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
          "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
    try:
        DeepSpeedConfig({**ds, "train_batch_size": 2})
        deepspeed_refuses = False
    except AssertionError:
        deepspeed_refuses = True
    assert deepspeed_refuses == refused
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, runner="deepspeed")
    invalid = [f for f in payload["findings"] if f["code"] == "deepspeed-config-invalid"]
    assert bool(invalid) == refused


def test_removed_keys_are_deepspeeds_own_each_reported_once_and_a_warning_on_an_older_deepspeed(tmp_path, monkeypatch,
                                                                                               capsys):
    """The table is the installed DeepSpeed's (it refuses the first it meets; check names every one, once, not also
    as deepspeed-config-invalid); on a DeepSpeed older than the release that removed them the same findings are
    warnings (the cluster's newer install refuses them)."""
    from deepspeed.runtime import config as ds_config

    from hf_scale.knowledge import deepspeed_changes

    capsys.readouterr()  # DeepSpeed's import notice
    removed = {*ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS,
               *(f"zero_optimization.{key}" for key in ds_config._REMOVED_ZERO_CONFIG_KEYS)}
    assert set(deepspeed_changes.REMOVED_KEYS) == removed
    ds = merged(DS_JSON, {"amp": {"enabled": True}, "curriculum_learning": {"enabled": False},
                          "progressive_layer_drop": {"enabled": False},
                          "zero_optimization": {"mics_shard_size": 8, "mics_hierarchical_params_gather": False}})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds)
    found = sorted((f["severity"], f["code"], f["key"]) for f in payload["findings"])
    assert found == [("error", "deepspeed-key-removed", key) for key in (
        "amp", "curriculum_learning", "progressive_layer_drop", "zero_optimization.mics_hierarchical_params_gather",
        "zero_optimization.mics_shard_size")]
    monkeypatch.setattr(deepspeed_changes, "version_of", lambda name: "0.19.2")
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(DS_JSON, {"elasticity": {}, "scheduler": {
        "type": "WarmupLR", "params": {"warmup_num_steps": 0}}}))
    changes = [f for f in payload["findings"] if f["code"].startswith("deepspeed-")]
    assert [(f["severity"], f["code"]) for f in changes] == [("warning", "deepspeed-key-removed"),
                                                             ("warning", "deepspeed-warmup-refused")]
    assert changes[0]["problem"].startswith("DeepSpeed >= 0.19.7 refuses the config at start: elastic training")
    assert "(installed here: 0.19.2)" in changes[1]["problem"]


@pytest.mark.parametrize(("steps", "refused"), [(0, True), (-5, True), (2.5, True), ("ten", True), (1, False),
                                                 ("auto", False)])
def test_warmup_schedulers_need_a_positive_whole_warmup(steps, refused):
    from hf_scale.knowledge import deepspeed_changes

    for scheduler in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        ds = {"scheduler": {"type": scheduler, "params": {"warmup_num_steps": steps}}}
        assert (deepspeed_changes.warmup_refused(ds) is not None) is refused
    assert deepspeed_changes.warmup_refused({"scheduler": {"type": "OneCycle", "params": {"warmup_num_steps": 0}}}) \
        is None
