"""`hf-scale check`'s inputs: unreadable or invalid files and flags are bad input (one line, exit 2)."""

from __future__ import annotations

import os

import pytest
import yaml
from check_cases import DDP_YAML, DS_JSON, DS_YAML, check_json, merged, run_cli

BAD_INPUTS = {
    "missing-yaml": (["--accelerate-config", "nope.yaml"], "--accelerate-config nope.yaml: not found"),
    "no-yaml-flag": ([], "--accelerate-config A.yaml is required"),
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
    from hf_scale.errors import UserError
    from hf_scale.train.main import build_parser

    try:
        _, unknown = build_parser().parse_known_args(argv)
        train_py_accepts = not unknown
    except UserError:
        train_py_accepts = False
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(DDP_YAML))
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
