"""`hf-scale check FILE...` (hf_scale.check.kinds): each file is recognized by its content, whatever its name, and a
file of no kind is one line naming what each kind looks like. (The public corpus,
tests/check/test_checks_peer_configs.py, is
checked this way too; the bad-input lines are in tests/commands/test_cli_bad_input.py.)"""

from __future__ import annotations

import json

import pytest
import yaml
from check_cases import DDP_YAML, DS_JSON, DS_YAML, run_cli

from hf_scale.check import kinds
from hf_scale.errors import UserError


def test_deepspeed_keys_come_from_deepspeeds_own_parser():
    keys = kinds.deepspeed_top_level_keys()
    assert {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "fp16", "bf16", "optimizer",
            "scheduler", "gradient_accumulation_steps", "autotuning", "activation_checkpointing"} <= keys
    assert not keys & {"distributed_type", "strategy", "topology", "learning_rate"}


@pytest.mark.parametrize(
    ("name", "data", "kind"),
    [
        ("ddp.yaml", DDP_YAML, kinds.ACCELERATE),
        ("config.yaml", {"distributed_type": "MULTI_GPU"}, kinds.ACCELERATE),  # accelerate's template: no more
        ("settings.json", DS_JSON, kinds.DEEPSPEED),  # any name
        ("ds.yaml", {"zero_optimization": {"stage": 2}}, kinds.DEEPSPEED),
        ("zero3.yaml", {"strategy": "deepspeed", "deepspeed": {"zero_stage": 3}}, kinds.HF_SCALE),
        ("run.json", {"precision": "bf16"}, kinds.HF_SCALE),
        ("run.yaml", {"strategy": "ddp", "optimizer": {"lr": 1e-5}, "gradient_clipping": 1.0}, kinds.HF_SCALE),
        ("opt.json", {"optimizer": {"type": "AdamW"}, "gradient_clipping": 1.0}, kinds.DEEPSPEED),
    ],
)
def test_each_kind_is_told_by_its_content(name, data, kind, tmp_path):
    path = tmp_path / name
    path.write_text(json.dumps(data) if name.endswith(".json") else yaml.safe_dump(data))
    assert kinds.file_kind(str(path)) == kind


@pytest.mark.parametrize("data", [{"model": "gpt2"}, {}, [1], "text", {"strategy": "ddp", "lr": 1}])
def test_a_file_of_no_kind_is_one_line_naming_each_kind(data, tmp_path):
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError) as error:
        kinds.file_kind(str(path))
    message = str(error.value)
    assert "\n" not in message and "not a file check reads" in message
    for kind in (kinds.ACCELERATE, kinds.DEEPSPEED, kinds.HF_SCALE):
        assert kind in message


def test_positional_files_check_what_the_flags_check(tmp_path, monkeypatch, capsys):
    """`hf-scale check acc.yaml ds.json -- ARGS` reports exactly what the --accelerate-config / --deepspeed-config
    form reports; the training args after `--` stay training args (a recipe YAML among them is not a FILE)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(DS_YAML))
    (tmp_path / "ds.json").write_text(json.dumps({**DS_JSON, "gradient_accumulation_steps": 4}))
    (tmp_path / "recipe.yaml").write_text("gradient_accumulation_steps: 2\n")
    flags = run_cli(["check", "--json", "--accelerate-config", "acc.yaml", "--deepspeed-config", "ds.json", "--",
                     "recipe.yaml"], capsys)
    positional = run_cli(["check", "--json", "ds.json", "acc.yaml", "--", "recipe.yaml"], capsys)
    assert positional[0] == flags[0] == 1
    assert json.loads(positional[1])["findings"] == json.loads(flags[1])["findings"]
    assert [f["code"] for f in json.loads(positional[1])["findings"]] == ["grad-accum-mismatch"]


def test_a_deepspeed_json_or_an_hf_scale_config_alone(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({**DS_JSON, "autotuning": {"enabled": True}}))
    code, out, _ = run_cli(["check", "--json", "ds.json"], capsys)
    payload = json.loads(out)
    assert (code, [f["code"] for f in payload["findings"]]) == (1, ["autotuning-enabled"])
    assert payload["summary"]["checked"] == ["ds.json"]
    (tmp_path / "run.yaml").write_text("strategy: deepspeed\ntopology: {processes_per_machine: 8}\n")
    code, out, _ = run_cli(["check", "--json", "run.yaml"], capsys)
    assert (code, json.loads(out)["findings"]) == (0, [])
    assert "run.yaml" in json.loads(out)["summary"]["checked"]


def test_a_job_manifest_given_as_a_file_is_checked_as_with_manifest(tmp_path, monkeypatch, capsys):
    """A SkyPilot task beside the accelerate YAML: checked as `--manifest` (several allowed); `num_processes: auto`
    leaves the processes per node to torchrun, so nothing is compared with it (and nothing crashes)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "acc.yaml").write_text(yaml.safe_dump({**DDP_YAML, "num_processes": 8}))
    (tmp_path / "task.yaml").write_text(yaml.safe_dump({"num_nodes": 2, "run": "bash launch.sh"}))
    positional = run_cli(["check", "--json", "acc.yaml", "task.yaml"], capsys)
    flagged = run_cli(["check", "--json", "acc.yaml", "--manifest", "task.yaml"], capsys)
    assert json.loads(positional[1])["findings"] == json.loads(flagged[1])["findings"]
    assert "manifest-nodes" in [f["code"] for f in json.loads(positional[1])["findings"]]
    (tmp_path / "auto.yaml").write_text(yaml.safe_dump({**DDP_YAML, "num_processes": "auto"}))
    (tmp_path / "one.yaml").write_text(yaml.safe_dump({"num_nodes": 1, "run": "bash launch.sh"}))
    code, out, err = run_cli(["check", "--json", "auto.yaml", "one.yaml"], capsys)
    assert code in (0, 1), err
    assert not [f for f in json.loads(out)["findings"] if f["code"] in ("manifest-processes", "manifest-gpus")]


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        ({"model_name_or_path": "gpt2"}, kinds.RECIPE),
        ({"bf16": True, "gradient_accumulation_steps": 4, "learning_rate": 1e-5}, kinds.RECIPE),
        ({"lora_r": 16, "env": {"HF_HUB_OFFLINE": "1"}}, kinds.RECIPE),  # train.py's recipe takes an env: mapping
        ({"bf16": {"enabled": True}, "gradient_accumulation_steps": 4}, kinds.DEEPSPEED),  # only keys both read
        ({"bf16": True, "zero_optimization": {"stage": 2}}, kinds.DEEPSPEED),  # a key train.py has no flag for
    ],
)
def test_a_train_py_recipe_is_told_from_a_deepspeed_config(data, kind):
    assert kinds.kind_of(data) == kind


def test_a_generated_recipe_is_refused_with_how_check_reads_it(tmp_path, monkeypatch, capsys):
    """`generate --recipe` writes a recipe whose keys include bf16 and gradient_accumulation_steps (DeepSpeed's too):
    it was read as a DeepSpeed config and refused as "not valid JSON". Now one line says what it is and how check
    reads it, and that way (after `--`) it checks."""
    monkeypatch.chdir(tmp_path)
    assert run_cli(["generate", "--preset", "zero2", "--recipe", "--output-dir", "."], capsys)[0] == 0
    code, out, err = run_cli(["check", "recipes/zero2.yaml"], capsys)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "JSON" not in err and "DeepSpeed" not in err
    assert "check: recipes/zero2.yaml is a train.py recipe" in err
    assert "hf-scale check CONFIG... -- recipes/zero2.yaml" in err
    code, out, err = run_cli(["check", "--json", "accelerate_configs/zero2.yaml", "--", "recipes/zero2.yaml"], capsys)
    assert code == 0, err
    assert json.loads(out)["summary"]["checked"][-1] == "training args"


def test_a_positional_hf_scale_config_is_named_as_the_file_it_is(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("strategy: ddp\ntopology: {processes_per_machine: 0}\n")
    code, _, err = run_cli(["check", "run.yaml"], capsys)
    assert code == 2 and err.startswith("hf-scale: error: check: hf_scale config run.yaml: topology.")
    code, _, err = run_cli(["check", "--", "--hf_scale_config", "run.yaml"], capsys)
    assert code == 2 and err.startswith("hf-scale: error: training args: --hf_scale_config run.yaml: topology.")
