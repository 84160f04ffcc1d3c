"""`hf-scale check`'s inputs: unreadable or invalid files and flags are bad input (one line, exit 2)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml
from check_cases import DDP_YAML, DS_JSON, DS_YAML, REPO, check_json, merged, run_cli

from hf_scale.config.presets import PLACEHOLDER_MAIN_IP, get_preset
from hf_scale.knowledge.rules import given_flags

BAD_INPUTS = {
    "missing-yaml": (["--accelerate-config", "nope.yaml"], "--accelerate-config nope.yaml: not found"),
    "no-file": ([], "check: no file to check: give an accelerate config (YAML with distributed_type"),
    "yaml-syntax": (["--accelerate-config", "broken.yaml"], "not valid YAML"),
    "yaml-not-mapping": (["--accelerate-config", "list.yaml"], "expected a mapping"),
    "json-syntax": (
        ["--accelerate-config", "acc.yaml", "--deepspeed-config", "broken.json"],
        "not valid JSON",
    ),
    "missing-json": (
        ["--accelerate-config", "acc.yaml", "--deepspeed-config", "nope.json"],
        "nope.json: not found",
    ),
    "referenced-json-missing": (
        ["--accelerate-config", "dangling.yaml"],
        "deepspeed_config_file='gone.json'",
    ),
    "unknown-runner": (["--accelerate-config", "acc.yaml", "--runner", "torchrun"], "--runner 'torchrun'"),
    "negative-gpus": (
        ["--accelerate-config", "acc.yaml", "--gpus-per-machine", "-1"],
        "--gpus-per-machine -1: must be >= 0",
    ),
    "bad-training-arg": (
        ["--accelerate-config", "acc.yaml", "--", "--per_device_train_batch_size", "four"],
        "invalid int value",
    ),
    # Parsed by train.py's own parser: what train.py refuses, check refuses (issue 15).
    "abbreviated-training-flag": (
        ["--accelerate-config", "acc.yaml", "--", "--per_device_train_batch_siz", "4"],
        "unrecognized arguments: --per_device_train_batch_siz",
    ),
    "flag-train-py-does-not-know": (
        ["--accelerate-config", "acc.yaml", "--", "--cpu"],
        "unrecognized arguments: --cpu",
    ),
    "missing-recipe": (["--accelerate-config", "acc.yaml", "--", "nope.yaml"], "nope.yaml"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_unreadable_input_is_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(DDP_YAML))
    (tmp_path / "broken.yaml").write_text("distributed_type: [DEEPSPEED\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.json").write_text('{"train_batch_size": 8,}')
    (tmp_path / "dangling.yaml").write_text(
        yaml.safe_dump(merged(DS_YAML, {"deepspeed_config": {"deepspeed_config_file": "gone.json"}}))
    )
    argv, message = BAD_INPUTS[case]
    code, out, err = run_cli(["check", *argv], capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("hf-scale: error: ") and message in err


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


# ---- the training args are parsed by train.py's own parser (issue 15) ---------------------------------------

TRAINING_ARGVS = [
    ["--per_device_train_batch_siz", "4"],
    ["--per_device_train_batch_size", "4"],
    ["--per-device-train-batch-size", "4"],
    ["--learning_rat", "1e-4"],
    ["--cpu"],
    ["--use_cpu"],
    ["--loop", "accelerate", "--hf_scale_config", "x.yaml", "--max_seq_length", "64"],
    ["--no_dataloader_pin_memory"],
    ["--bf16", "maybe"],
]


@pytest.mark.parametrize("argv", TRAINING_ARGVS, ids=" ".join)
def test_check_accepts_exactly_the_training_args_train_py_accepts(argv, tmp_path, monkeypatch, capsys):
    from hf_scale.contract.parser import build_parser
    from hf_scale.errors import UserError

    try:
        _, unknown = build_parser().parse_known_args(argv)
        train_py_accepts = not unknown
    except UserError:
        train_py_accepts = False
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(DDP_YAML))
    shutil.copy(REPO / "hf_scale_configs" / "ddp.yaml", tmp_path / "x.yaml")  # for --hf_scale_config x.yaml
    code, _, err = run_cli(["check", "--accelerate-config", "acc.yaml", "--", *argv], capsys)
    assert (code != 2) == train_py_accepts, err
    assert code != 2 or (err.count("\n") == 1 and "training args: " in err)


@pytest.mark.parametrize("spelling", [["--gradient_accumulation_steps", "4"], ["--gradient-accumulation-steps=4"],
                                      ["recipe.yaml"], ["--config", "recipe.yaml"]])
def test_a_flag_is_given_in_every_spelling_train_py_takes_and_from_a_recipe(spelling, tmp_path, monkeypatch,
                                                                              capsys):
    """The dashed spelling and a recipe's value are typed flags for train.py (not defaults): check names them so,
    and a recipe's `env:` stays out of the check's own process."""
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"gradient_accumulation_steps": 4,
                                                          "env": {"HF_SCALE_CHECK_TEST_ENV": "1"}}))
    ds = merged(DS_JSON, {"gradient_accumulation_steps": 2})
    _, payload = check_json(tmp_path, monkeypatch, capsys, DS_YAML, ds, spelling)
    (finding,) = [f for f in payload["findings"] if f["code"] == "grad-accum-mismatch"]
    assert finding["values"] == {"ds.json:gradient_accumulation_steps": 2,
                                 "training args:--gradient_accumulation_steps": 4}
    assert "HF_SCALE_CHECK_TEST_ENV" not in os.environ


# ---- --hf_scale_config fills the flags as train.py does (issue 15) ----------------------------------------------

PRESETS = sorted(path.stem for path in (REPO / "hf_scale_configs").glob("*.yaml"))
# A multinode preset ships a placeholder address: its launch scripts take MAIN_PROCESS_IP (a warning by design).
_PLACEHOLDER_IP = {name for name in PRESETS if get_preset(name).topology.main_process_ip == PLACEHOLDER_MAIN_IP}


def _check_repo(monkeypatch, capsys, name: str, train: list[str]) -> tuple[int, dict]:
    """`hf-scale check` on the checked-in files of preset `name`, from the repo root, as its launch scripts run."""
    monkeypatch.chdir(REPO)
    argv = ["check", "--accelerate-config", f"accelerate_configs/{name}.yaml", "--json"]
    code, out, err = run_cli([*argv, "--", *train] if train else argv, capsys)
    assert code in (0, 1), err
    return code, json.loads(out)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_is_clean_as_its_launch_scripts_launch_it(name, tmp_path, monkeypatch, capsys):
    """The generated scripts pass exactly `--hf_scale_config hf_scale_configs/NAME.yaml`: check applies it as
    train.py does (batch, precision, clipping, optimizer values filled before anything compares them). An expert-
    parallel preset is checked with the mixture-of-experts model it is for (8 experts: ep 2 splits them)."""
    assert len(PRESETS) >= 10
    train = ["--hf_scale_config", f"hf_scale_configs/{name}.yaml"]
    if get_preset(name).parallelism.ep:
        from transformers import Qwen3MoeConfig

        Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                       num_experts_per_tok=2, vocab_size=128).save_pretrained(tmp_path / "moe8")
        train += ["--model_name_or_path", str(tmp_path / "moe8")]
    code, payload = _check_repo(monkeypatch, capsys, name, train)
    expected = ["main-ip-placeholder"] if name in _PLACEHOLDER_IP else []
    assert (code, [f["code"] for f in payload["findings"]]) == (0, expected), payload["findings"]


def test_a_precision_flag_left_out_follows_the_deepspeed_json_as_in_train_py(monkeypatch, capsys):
    """zero3's JSON says bf16.enabled=true: train.py follows it when --bf16 is left out (not an error); a plain
    HF Trainer script would stop, which the warning says, with the fix."""
    code, payload = _check_repo(monkeypatch, capsys, "zero3", [])
    assert (code, payload["findings"]) == (0, [])
    code, payload = _check_repo(monkeypatch, capsys, "zero3", ["--max_steps", "3"])
    assert code == 0 and payload["summary"]["errors"] == 0
    (finding,) = payload["findings"]
    assert (finding["severity"], finding["code"], finding["where"]) == (
        "warning", "precision-mismatch", "ds_configs/zero3.json:bf16.enabled")
    assert "train.py follows the file (bf16)" in finding["problem"] and "plain HF Trainer" in finding["problem"]
    assert "--bf16" in finding["fix"] and '"auto"' in finding["fix"] and "zero3.json" in finding["fix"]


def test_a_flag_contradicting_the_hf_scale_config_is_an_error_with_train_py_message(monkeypatch, capsys):
    from hf_scale.config.distributed_config import load_config
    from hf_scale.contract.config_flags import fill_flags_from_config
    from hf_scale.contract.parser import build_parser

    flags = ["--hf_scale_config", "hf_scale_configs/zero3.yaml", "--per_device_train_batch_size", "4"]
    code, payload = _check_repo(monkeypatch, capsys, "zero3", flags)
    assert code == 1
    (finding,) = payload["findings"]
    assert (finding["severity"], finding["code"]) == ("error", "hf-scale-config-mismatch")
    assert finding["where"] == "hf_scale_configs/zero3.yaml:batch.micro_batch_size"
    # train.py's own sentence (the same function fills its flags and stops on it).
    ns = build_parser().parse_args(flags)
    (said,) = fill_flags_from_config(load_config(REPO / "hf_scale_configs/zero3.yaml"),
                                     ns, given_flags(flags, vars(ns)), "--hf_scale_config=x").contradictions
    assert said.endswith("batch.micro_batch_size=1 but --per_device_train_batch_size=4")
    assert finding["problem"].startswith(said.removeprefix("--hf_scale_config=x: "))
    assert "--per_device_train_batch_size" in finding["fix"] and "zero3.yaml" in finding["fix"]


@pytest.mark.parametrize("written", ["missing.yaml", "acc.yaml"])
def test_a_missing_or_invalid_hf_scale_config_is_one_line_exit_2(written, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(DDP_YAML))  # an accelerate YAML is no DistributedConfig
    code, out, err = run_cli(["check", "--accelerate-config", "acc.yaml", "--", "--hf_scale_config", written], capsys)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and f"training args: --hf_scale_config {written}: " in err


# (accelerate YAML preset, --hf_scale_config preset) -> what train.py's apply_hf_scale_config sees under
# `accelerate launch` of that YAML (LaunchRequest: strategy, world size, ZeRO stage, JSON).
LAUNCH_CONTRADICTIONS = {
    ("zero2", "zero3"): ("deepspeed", 8, 2, "ds_configs/zero2.json", "deepspeed.zero_stage"),
    ("zero3", "ddp"): ("deepspeed", 8, 3, "ds_configs/zero3.json", "strategy"),
    ("ddp", "ddp_multinode"): ("ddp", 8, None, None, "world_size"),
}


@pytest.mark.parametrize("pair", sorted(LAUNCH_CONTRADICTIONS), ids="-with-".join)
def test_a_launch_the_hf_scale_config_refuses_is_an_error_with_train_py_message(pair, monkeypatch, capsys):
    """World size, engine and ZeRO stage of the accelerate YAML against --hf_scale_config: train.py stops, so does
    check, with the sentence train.py says."""
    from hf_scale.contract.launch_request import LaunchRequest
    from hf_scale.contract.parser import build_parser
    from hf_scale.errors import UserError
    from hf_scale.train.setup.reconcile import apply_hf_scale_config

    yaml_name, config_name = pair
    strategy, world, stage, json_file, key = LAUNCH_CONTRADICTIONS[pair]
    flags = ["--hf_scale_config", f"hf_scale_configs/{config_name}.yaml"]
    code, payload = _check_repo(monkeypatch, capsys, yaml_name, flags)
    assert code == 1
    (finding,) = [f for f in payload["findings"] if f["severity"] == "error"]
    assert (finding["code"], finding["where"]) == ("hf-scale-config-mismatch", f"{flags[1]}:{key}")
    request = LaunchRequest("accelerate", world, strategy, json_file, stage, None)
    with pytest.raises(UserError) as said:
        ns = build_parser().parse_args(flags)
        apply_hf_scale_config(flags[1], request, ns, given_flags(flags, vars(ns)))
    assert finding["problem"] == f"{str(said.value).removeprefix(f'--hf_scale_config={flags[1]}: ')}: train.py " \
                                 "stops at start on this."
    assert f"{config_name}.yaml" in finding["fix"] and f"`{key}`" in finding["fix"]


@pytest.mark.parametrize(("accelerate", "launch_env", "want"), [
    ({"distributed_type": "MULTI_GPU"}, None, None),
    ({"distributed_type": "FSDP", "fsdp_config": {}}, None, 1),  # accelerate's default
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}, None, 2),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": "2"}}, None, 2),
    ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}, {"FSDP_VERSION": "1"}, 1),  # what runs
    ({"distributed_type": "FSDP", "fsdp_config": {}}, {"FSDP_VERSION": "2"}, 2),
])
def test_the_fsdp_version_is_read_once_as_accelerate_launch_runs_it(accelerate, launch_env, want):
    """One reading for every check that depends on it (qlora-fsdp1, the parallelism layout, the FSDP final save):
    the variable accelerate's launch code exports wins over the YAML."""
    from hf_scale.check.inputs import CheckInputs, fsdp_version_of

    inp = CheckInputs(runner="trainer", accelerate_file="a.yaml", accelerate=accelerate, launch_env=launch_env)
    assert fsdp_version_of(inp) == want


def test_a_deepspeed_file_named_under_another_distributed_type_is_not_opened(tmp_path, monkeypatch, capsys):
    """accelerate reads deepspeed_config only for distributed_type DEEPSPEED: a NO YAML naming a missing JSON
    launches (exit 0), so check does not refuse it for the missing file."""
    yaml_cfg = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "num_processes": 1,
                "deepspeed_config": {"deepspeed_config_file": "missing.json"}}
    code, payload = check_json(tmp_path, monkeypatch, capsys, yaml_cfg)
    assert code in (0, 1) and "deepspeed_config_file" not in json.dumps(payload["summary"]), payload
