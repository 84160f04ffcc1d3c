"""`hf-scale check`, what the HF Trainer compares at launch (hf_scale.check.trainer_values)."""

from __future__ import annotations

import inspect
import json
import re

import pytest
import yaml
from check_cases import (
    DS_JSON,
    DS_YAML,
    REPO,
    assert_every_fix_names_where_the_value_is,
    assert_reports_its_problem,
    check_json,
    codes,
    merged,
    run_cli,
)

# id -> (yaml, json, training args, runner, extra CLI args, expected code, expected severity)
TRIGGERS = {
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
        "warning",  # train.py takes the JSON's betas; a plain HF Trainer script stops
    ),
    "concrete-betas-vs-typed-flag": (
        DS_YAML,
        merged(DS_JSON, {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": [0.9, 0.95]}}}),
        ["--bf16", "--adam_beta2", "0.999"],
        None,
        [],
        "ds-trainer-mismatch",
        "error",
    ),
    # accelerate's tp layout with a config whose layout is plain FSDP (same world, same engine): train.py refuses it
    "hf-scale-config-vs-parallelism-config": (
        yaml.safe_load((REPO / "accelerate_configs" / "fsdp2_tp.yaml").read_text()),
        None,
        ["--hf_scale_config", str(REPO / "hf_scale_configs" / "fsdp2_full_shard.yaml")],
        None,
        [],
        "hf-scale-config-mismatch",
        "error",
    ),
    "hf-scale-config-vs-typed-flag": (
        DS_YAML,
        DS_JSON,
        ["--hf_scale_config", str(REPO / "hf_scale_configs" / "zero2.yaml"), "--learning_rate", "1e-3"],
        None,
        [],
        "hf-scale-config-mismatch",
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


# ---- every value transformers compares at launch (HfTrainerDeepSpeedConfig.fill_match), issue 15 --------------

ADAMW = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
WARMUP_DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                    "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                    "warmup_type": "linear"}}


def _optimizer(**params) -> dict:
    return {"optimizer": merged(ADAMW, {"params": params})}


def _scheduler(**params) -> dict:
    return {"scheduler": merged(WARMUP_DECAY, {"params": params})}


# DeepSpeed key -> (JSON change, flags that disagree, flags that agree, the code that reports it)
COMPARED = {
    "train_micro_batch_size_per_gpu": ({"train_micro_batch_size_per_gpu": 4}, ["--per_device_train_batch_size", "2"],
                                       ["--per_device_train_batch_size", "4"], "micro-batch-mismatch"),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 4}, ["--gradient_accumulation_steps", "2"],
                                    ["--gradient_accumulation_steps", "4"], "grad-accum-mismatch"),
    "train_batch_size": ({"train_batch_size": 64}, ["--per_device_train_batch_size", "4"],
                         ["--per_device_train_batch_size", "32"], "train-batch-mismatch"),
    "gradient_clipping": ({"gradient_clipping": 0.5}, ["--max_grad_norm", "1.0"], ["--max_grad_norm", "0.5"],
                          "ds-trainer-mismatch"),
    "optimizer.params.lr": (_optimizer(lr=2e-5), ["--learning_rate", "5e-5"], ["--learning_rate", "2e-5"],
                            "ds-trainer-mismatch"),
    "optimizer.params.betas": (_optimizer(betas=[0.9, 0.95]), ["--adam_beta2", "0.999"], ["--adam_beta2", "0.95"],
                               "ds-trainer-mismatch"),
    "optimizer.params.eps": (_optimizer(eps=1e-6), ["--adam_epsilon", "1e-8"], ["--adam_epsilon", "1e-6"],
                             "ds-trainer-mismatch"),
    "optimizer.params.weight_decay": (_optimizer(weight_decay=0.1), ["--weight_decay", "0.0"],
                                      ["--weight_decay", "0.1"], "ds-trainer-mismatch"),
    "scheduler.params.warmup_max_lr": (_scheduler(warmup_max_lr=1e-4), ["--learning_rate", "5e-5"],
                                       ["--learning_rate", "1e-4"], "ds-trainer-mismatch"),
    "scheduler.params.total_num_steps": (_scheduler(total_num_steps=100), ["--max_steps", "10"],
                                         ["--max_steps", "100"], "ds-trainer-mismatch"),
    "scheduler.params.warmup_num_steps": (_scheduler(warmup_num_steps=5), ["--warmup_steps", "3"],
                                          ["--warmup_steps", "5"], "ds-trainer-mismatch"),
    "fp16.enabled": ({"fp16": {"enabled": True}, "bf16": None}, ["--bf16"], ["--fp16"], "precision-mismatch"),
    "bf16.enabled": ({"bf16": {"enabled": True}}, ["--fp16"], ["--bf16"], "precision-mismatch"),
}


def test_check_compares_every_value_transformers_compares_at_launch():
    """The cases below cover every `fill_match` of transformers' HfTrainerDeepSpeedConfig (the comparison that
    raises "mismatch TrainingArguments" at launch); a comparison added in a later transformers fails here."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    source = inspect.getsource(HfTrainerDeepSpeedConfig)
    compared = set(re.findall(r'fill_match\(\s*"([\w.]+)"', source))
    assert compared == set(COMPARED)


@pytest.mark.parametrize("key", sorted(COMPARED))
def test_a_value_the_trainer_compares_is_a_finding_when_it_differs(key, tmp_path, monkeypatch, capsys):
    change, disagree, agree, code = COMPARED[key]
    ds = merged(DS_JSON, change)
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, disagree)
    found = [f for f in payload["findings"] if f["code"] == code]
    assert found and {f["severity"] for f in found} == {"error"}, payload["findings"]
    finding = found[0]
    assert "ds.json" in finding["fix"] or "training args" in finding["fix"] or "--" in finding["fix"]
    if code == "ds-trainer-mismatch":
        (finding,) = found
        flag = disagree[0]
        assert finding["where"] == f"ds.json:{key}"
        assert f"ds.json:{key}" in finding["values"] and any(flag in where for where in finding["values"])
        assert "(default)" not in finding["problem"] and "train.py stop at start" in finding["problem"]
        assert f"In ds.json, set `{key}`" in finding["fix"] and flag in finding["fix"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, agree)
    assert code not in codes(payload), payload["findings"]


def test_a_resolved_learning_rate_against_the_flag_is_one_line_naming_both_values(tmp_path, monkeypatch, capsys):
    """Issue 15: `check` said ok where the launch died with transformers' 105-line traceback
    `ds optimizer.params.lr=2e-05 vs hf learning_rate=5e-05`."""
    resolved = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                "gradient_clipping": 1.0, "bf16": {"enabled": True}}
    ds = merged(DS_JSON, {**resolved, **_optimizer(lr=2e-5, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0)})
    code, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, ["--learning_rate", "5e-5", "--bf16"])
    assert code == 1
    (finding,) = payload["findings"]
    assert finding["values"] == {"ds.json:optimizer.params.lr": 2e-5, "training args:--learning_rate": 5e-5}
    assert finding["problem"].startswith("optimizer.params.lr=2e-05 but --learning_rate=5e-05:")


def test_a_default_flag_is_named_as_such_and_train_py_follows_the_json(tmp_path, monkeypatch, capsys):
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, merged(DS_JSON, _optimizer(lr=2e-5)), ["--bf16"])
    (finding,) = [f for f in payload["findings"] if f["code"] == "ds-trainer-mismatch"]
    assert finding["severity"] == "warning" and payload["summary"]["errors"] == 0
    assert "--learning_rate=5e-05 (default)" in finding["problem"] and "train.py takes the JSON's value" in finding[
        "problem"]


def test_warmup_ratio_is_compared_in_steps(tmp_path, monkeypatch, capsys):
    ds = merged(DS_JSON, _scheduler(warmup_num_steps=5, total_num_steps=100))
    flags = ["--warmup_ratio", "0.1", "--max_steps", "100"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, flags)
    (finding,) = [f for f in payload["findings"] if f["code"] == "ds-trainer-mismatch"]
    assert finding["key"] == "scheduler.params.warmup_num_steps" and "=10 steps" in finding["problem"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, ["--warmup_ratio", "0.05", *flags[2:]])
    assert "ds-trainer-mismatch" not in codes(payload)


def _generate_resolved(tmp_path, monkeypatch, capsys, preset: str) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["generate", "--preset", preset, "--deepspeed-mode", "resolved", "--set",
                            "optimizer.lr=3e-4", "--output-dir", str(tmp_path)], capsys)
    assert code == 0, err


def _check_generated(capsys, preset: str, train: list[str]) -> tuple[int, dict]:
    code, out, err = run_cli(["check", "--accelerate-config", f"accelerate_configs/{preset}.yaml", "--json", "--",
                              *train], capsys)
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.mark.parametrize("preset", ["zero2", "zero2_offload"])
def test_a_resolved_json_is_clean_with_the_hf_scale_config_its_scripts_pass(preset, tmp_path, monkeypatch, capsys):
    """Issue 15: resolved values (lr 3e-4, micro batch, bf16) against flags left at their defaults are no error:
    --hf_scale_config fills the flags first, as train.py does."""
    _generate_resolved(tmp_path, monkeypatch, capsys, preset)
    code, payload = _check_generated(capsys, preset, ["--hf_scale_config", f"hf_scale_configs/{preset}.yaml"])
    assert (code, payload["findings"]) == (0, [])


def test_a_resolved_lr_against_a_typed_learning_rate_is_an_error_naming_both(tmp_path, monkeypatch, capsys):
    """zero2_offload's resolved JSON has an optimizer block (DeepSpeed builds its CPU Adam; plain zero2 has none)."""
    _generate_resolved(tmp_path, monkeypatch, capsys, "zero2_offload")
    code, payload = _check_generated(capsys, "zero2_offload", ["--learning_rate", "5e-5"])
    assert code == 1
    (error,) = [f for f in payload["findings"] if f["severity"] == "error"]
    assert (error["code"], error["key"]) == ("ds-trainer-mismatch", "optimizer.params.lr")
    assert error["problem"].startswith("optimizer.params.lr=0.0003 but --learning_rate=5e-05:")
    # The values train.py follows (bf16, micro batch 1) are warnings for a plain HF Trainer script.
    assert {f["code"] for f in payload["findings"] if f["severity"] == "warning"} == {"precision-mismatch",
                                                                                      "micro-batch-mismatch"}


def test_a_parallelism_config_other_than_the_hf_scale_configs_is_train_pys_refusal_in_its_words(tmp_path, monkeypatch,
                                                                                                 capsys):
    """`check accelerate_configs/fsdp2_tp.yaml` with hf_scale_configs/fsdp2_full_shard.yaml said ok; train.py then
    refused at start. Now one function (hf_scale.contract.config_flags.launched_layout_mismatch) says it for both."""
    yaml_cfg, _, train, *_ = TRIGGERS["hf-scale-config-vs-parallelism-config"]
    _, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg, None, train)
    found = [f for f in payload["findings"] if f["code"] == "hf-scale-config-mismatch"]
    assert [(f["key"], f["problem"]) for f in found] == [(
        "parallelism", "parallelism dp_shard=8 but the accelerate config's parallelism_config has dp_shard=4 x tp=2: "
        "train.py stops at start on this.")]


def test_deepspeed_with_a_config_whose_strategy_is_not_deepspeed_is_train_pys_refusal(tmp_path, monkeypatch, capsys):
    """`--deepspeed ds.json` with a ddp hf_scale config: train.py stops at start (config_flags.fill_flags_from_config,
    the rule generate applies to cluster.train_args too); check says it."""
    (tmp_path / "ds.json").write_text(json.dumps(DS_JSON))
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, None,
                            ["--hf_scale_config", str(REPO / "hf_scale_configs" / "ddp.yaml"),
                             "--deepspeed", "ds.json"])
    problems = [f["problem"] for f in payload["findings"] if f["code"] == "hf-scale-config-mismatch"]
    refusal = "strategy=ddp but --deepspeed=ds.json asks for DeepSpeed; drop --deepspeed"
    assert any(p.startswith(refusal) for p in problems), problems


# rule -> (accelerate YAML preset, changes to it, hf_scale config preset): a launch that breaks that one rule of
# train.py's (hf_scale.train.setup.reconcile), the finding's key.
ONE_RULE_BROKEN = {
    "world_size": ("ddp", {}, "ddp_multinode"),
    "strategy": ("zero3", {}, "ddp"),
    "deepspeed.zero_stage": ("zero2", {}, "zero3"),
    "parallelism": ("fsdp2_tp", {}, "fsdp2_full_shard"),
    "precision": ("ddp", {"mixed_precision": "fp16"}, "ddp"),
    "fsdp.activation_checkpointing": ("fsdp2_full_shard", {"fsdp_config": {"fsdp_activation_checkpointing": True}},
                                      "fsdp2_full_shard"),
}


@pytest.mark.parametrize("rule", sorted(ONE_RULE_BROKEN))
def test_check_and_train_py_say_the_same_line_for_each_launch_rule(rule, tmp_path, monkeypatch, capsys):
    """Issue 30: check restated train.py's start rules. Now both call the same functions: check on the files, and
    train.py's own prepare path (detect_launch + apply_hf_scale_config) under the environment accelerate's launch
    code computes for the same YAML, give one line, word for word."""
    from hf_scale.check.inputs import load_inputs
    from hf_scale.contract.parser import build_parser
    from hf_scale.errors import UserError
    from hf_scale.train.setup.distributed import detect_launch
    from hf_scale.train.setup.reconcile import apply_hf_scale_config

    yaml_name, changes, config_name = ONE_RULE_BROKEN[rule]
    monkeypatch.chdir(REPO)
    written = merged(yaml.safe_load((REPO / f"accelerate_configs/{yaml_name}.yaml").read_text()), changes)
    accelerate = tmp_path / f"{yaml_name}.yaml"
    accelerate.write_text(yaml.safe_dump(written))
    config = f"hf_scale_configs/{config_name}.yaml"
    code, out, err = run_cli(["check", "--accelerate-config", str(accelerate), "--json", "--", "--hf_scale_config",
                              config], capsys)
    said = [(f["key"], f["problem"]) for f in json.loads(out)["findings"] if f["code"] == "hf-scale-config-mismatch"]

    env = load_inputs(str(accelerate), training_args=["--hf_scale_config", config]).launch_env
    assert env is not None
    for name, value in {**env, "WORLD_SIZE": str(written["num_processes"])}.items():
        monkeypatch.setenv(name, value)
    ns = build_parser().parse_args(["--hf_scale_config", config])
    with pytest.raises(UserError) as refused:
        apply_hf_scale_config(config, detect_launch(None), ns, {"hf_scale_config"})
    line = str(refused.value).removeprefix(f"--hf_scale_config={config}: ")
    assert (code, said) == (1, [(rule, f"{line}: train.py stops at start on this.")]), err
