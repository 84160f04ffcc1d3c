"""`hf-scale check`'s inputs: unreadable or invalid files and flags are bad input (one line, exit 2)."""

from __future__ import annotations

import pytest
import yaml
from check_cases import DDP_YAML, DS_YAML, merged, run_cli

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
