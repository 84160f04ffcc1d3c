"""hf_scale.knowledge.rules: each rule of a run in one place, proven against the libraries and train.py's parser.
In-process and fast."""

from __future__ import annotations

import pytest

from hf_scale.knowledge import rules


@pytest.fixture(scope="module")
def train_py_parser():
    from hf_scale.contract.parser import build_parser

    return build_parser()


def test_given_flags_knows_every_spelling_of_train_py_parser_and_nothing_else(train_py_parser):
    """Every option string of train.py's parser counts as its field given; an abbreviation or a prefix never does
    (train.py's parser has allow_abbrev=False)."""
    assert train_py_parser.allow_abbrev is False
    names = {action.dest for action in train_py_parser._actions}
    for option, action in train_py_parser._option_string_actions.items():
        if not option.startswith("--") or action.dest == "help":
            continue
        assert rules.given_flags([option], names) == {action.dest}, (option, action.dest)
        assert rules.given_flags([f"{option}=1"], names) == {action.dest}, option
        assert action.dest not in rules.given_flags([option[:-1]], names), option


@pytest.mark.parametrize(
    ("argv", "name", "given"),
    [
        (["--per_device_train_batch_size", "4"], "per_device_train_batch_size", True),
        (["--per-device-train-batch-size=4"], "per_device_train_batch_size", True),
        (["--per_device_train_batch_siz", "4"], "per_device_train_batch_size", False),
        (["--bf16"], "fp16", False),
        (["--no_dataloader_pin_memory"], "dataloader_pin_memory", True),
        (["--run_name", "bf16"], "bf16", False),
    ],
)
def test_given_flags(argv, name, given):
    assert (name in rules.given_flags(argv, [name, "fp16", "bf16", "run_name"])) is given


def test_given_flags_reads_every_word_once_and_names_each_flag_once():
    argv = ["--bf16", "--learning_rate=1e-4", "--run_name", "fp16", "--no-dataloader-pin-memory", "--bf16"]
    names = ["bf16", "fp16", "learning_rate", "run_name", "dataloader_pin_memory", "seed"]
    assert rules.given_flags(argv, names) == {"bf16", "learning_rate", "run_name", "dataloader_pin_memory"}


# ---- batch and precision -------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed"])
def test_the_config_fills_its_batch_with_the_rule(strategy):
    from hf_scale.config.distributed_config import DistributedConfig

    cfg = DistributedConfig.model_validate({"strategy": strategy, "topology": {"num_machines": 1,
                                                                               "processes_per_machine": 8},
                                            "batch": {"micro_batch_size": 2, "gradient_accumulation_steps": 3}})
    assert cfg.batch.global_batch_size == rules.global_batch_size(2, 3, 8) == 48


def test_the_global_batch_is_what_deepspeed_computes():
    """DeepSpeed's own arithmetic (DeepSpeedConfig._configure_train_batch_size) derives the same number."""
    from deepspeed.runtime.config import DeepSpeedConfig

    config = object.__new__(DeepSpeedConfig)
    config.train_batch_size, config.train_micro_batch_size_per_gpu = None, 3
    config.gradient_accumulation_steps, config.world_size = 5, 7
    config._configure_train_batch_size()
    assert config.train_batch_size == rules.global_batch_size(3, 5, 7)


@pytest.mark.parametrize(("bf16", "fp16", "precision"), [(True, False, "bf16"), (False, True, "fp16"),
                                                         (False, False, "no")])
def test_precision_from_flags(bf16, fp16, precision):
    assert rules.precision_from_flags(bf16, fp16) == precision
    assert precision in rules.PRECISIONS


def test_both_precisions_are_refused_in_one_place(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(ValueError, match=rules.BOTH_PRECISIONS):
        rules.precision_from_flags(True, True)
    # TrainingArguments refuses the pair too (whichever check it reaches first on this machine).
    with pytest.raises(ValueError):
        TrainingArguments(output_dir=str(tmp_path), bf16=True, fp16=True, use_cpu=True, report_to=[])


# ---- Dtype spellings -----------------------------------------------------------------------------------------


def test_every_dtype_spelling_names_a_torch_dtype_and_both_spellings_agree():
    import torch

    for spelling, name in rules.TORCH_DTYPE_OF.items():
        assert isinstance(getattr(torch, name), torch.dtype), spelling
        assert rules.TORCH_DTYPE_OF[name] == name  # torch's own spelling maps to itself
    assert {rules.torch_dtype_name(s, "--x") for s in ("bf16", "bfloat16")} == {"bfloat16"}
    assert {rules.torch_dtype_name(s, "--x") for s in ("fp16", "float16")} == {"float16"}
    assert {rules.torch_dtype_name(s, "--x") for s in ("fp32", "float32")} == {"float32"}
    assert rules.torch_dtype_name("auto", "--x") == "auto"
    # The short spellings are the precisions of the config / accelerate (fp32 is precision "no").
    assert [rules.precision_of(s, "--precision") for s in ("bfloat16", "bf16", "float16", "fp32", "float32", "no")] == [
        "bf16", "bf16", "fp16", "no", "no", "no"]
    assert [s for s in rules.TORCH_DTYPE_OF if rules.is_half_dtype(s)] == ["bf16", "bfloat16", "fp16", "float16"]


def test_an_unknown_dtype_is_one_line_naming_every_allowed_spelling():
    with pytest.raises(ValueError) as error:
        rules.torch_dtype_name("float8", "--dtype")
    assert str(error.value) == "--dtype 'float8' is invalid: allowed auto, bf16, bfloat16, fp16, float16, fp32, float32"
    with pytest.raises(ValueError, match="--precision 'auto' is invalid: allowed no, bf16, fp16, bfloat16"):
        rules.precision_of("auto", "--precision")


def test_every_command_takes_the_dtype_spellings_of_the_one_table(train_py_parser):
    """train.py's --torch_dtype, export's --dtype and plan's --precision offer exactly the table's spellings, and
    what they load is the table's torch dtype."""
    import argparse

    import torch

    from hf_scale.commands.export import register as register_export
    from hf_scale.commands.plan import add_plan_arguments
    from hf_scale.train.model.load import load_dtype

    assert tuple(train_py_parser._option_string_actions["--torch_dtype"].choices) == rules.DTYPE_CHOICES
    export_parser = argparse.ArgumentParser()
    register_export(export_parser.add_subparsers())
    export_sub = export_parser._subparsers._group_actions[0].choices["export"]
    assert tuple(export_sub._option_string_actions["--dtype"].choices) == rules.DTYPE_CHOICES
    plan_parser = argparse.ArgumentParser()
    add_plan_arguments(plan_parser)
    assert tuple(plan_parser._option_string_actions["--precision"].choices) == rules.PRECISION_CHOICES
    assert [load_dtype(s) for s in ("bf16", "bfloat16", "fp16", "float16", "fp32", "float32", "auto")] == [
        torch.bfloat16, torch.bfloat16, torch.float16, torch.float16, torch.float32, torch.float32, "auto"]


def test_export_resolves_either_spelling_and_a_saved_dtype_through_the_table(tmp_path):
    import json

    import torch

    from hf_scale.commands.export import _resolve_dtype
    from hf_scale.errors import UserError

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # export reads it for any --dtype
    assert _resolve_dtype("bfloat16", tmp_path) is _resolve_dtype("bf16", tmp_path) is torch.bfloat16
    for saved, dtype in (("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float64", torch.float64),
                         ("nonsense", torch.float32)):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": saved}))
        assert _resolve_dtype("auto", tmp_path) is dtype, saved
    with pytest.raises(UserError, match="^--dtype 'fp8' is invalid: allowed auto, bf16, bfloat16, "):
        _resolve_dtype("fp8", tmp_path)


# ---- DeepSpeed keys ------------------------------------------------------------------------------------------


def _auto_paths(node, prefix=""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _auto_paths(value, f"{prefix}{key}.")
    elif node == "auto":
        yield prefix[:-1]


def test_the_generated_json_writes_auto_only_where_the_trainer_fills_it():
    """generators/deepspeed_json.py's "auto" mode and check's `auto-unresolvable` use the one table."""
    from hf_scale.config.presets import PRESETS, get_preset
    from hf_scale.contract.deepspeed_json import deepspeed_config

    seen = set()
    for name in PRESETS:
        cfg = get_preset(name)
        if cfg.strategy != "deepspeed":
            continue
        for stage, offload in ((cfg.deepspeed.zero_stage, cfg.deepspeed.offload_optimizer), (3, "cpu"), (2, "none")):
            variant = cfg.model_copy(update={"deepspeed": cfg.deepspeed.model_copy(
                update={"zero_stage": stage, "offload_optimizer": offload})})
            paths = set(_auto_paths(deepspeed_config(variant, "auto")))
            assert all(rules.trainer_fills(path, stage) for path in paths), paths
            assert not set(_auto_paths(deepspeed_config(variant, "resolved")))
            seen |= paths
    assert {"train_batch_size", "optimizer.params.lr"} <= seen


def test_the_yaml_to_json_map_reads_back_what_it_writes():
    section = {yaml_key: f"value of {yaml_key}" for yaml_key in rules.ACCELERATE_YAML_TO_DEEPSPEED}
    config = rules.deepspeed_config_from_yaml(section)
    for yaml_key, path in rules.ACCELERATE_YAML_TO_DEEPSPEED.items():
        node = config
        for part in path.split("."):
            node = node[part]
        assert node == section[yaml_key]
        assert rules.yaml_key_of(path) == yaml_key
    assert rules.deepspeed_config_from_yaml({}) == {"zero_optimization": {"stage": rules.ACCELERATE_DEFAULT_ZERO_STAGE}}
    assert rules.yaml_key_of("optimizer.params.lr") is None


def test_accelerate_builds_the_same_config_from_the_yaml_keys(monkeypatch):
    """accelerate's DeepSpeedPlugin (no config file) sets each mapped JSON path from its YAML key, and defaults to
    the stage the rule assumes."""
    from accelerate.utils import DeepSpeedPlugin

    assert DeepSpeedPlugin().zero_stage == rules.ACCELERATE_DEFAULT_ZERO_STAGE
    plugin = DeepSpeedPlugin(gradient_accumulation_steps=3, gradient_clipping=0.5, zero_stage=3,
                             offload_optimizer_device="cpu", offload_param_device="cpu", zero3_save_16bit_model=True)
    built = rules.deepspeed_config_from_yaml({"gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
                                              "zero_stage": 3, "offload_optimizer_device": "cpu",
                                              "offload_param_device": "cpu", "zero3_save_16bit_model": True})
    for path in ("gradient_accumulation_steps", "gradient_clipping", "zero_optimization.stage",
                 "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
                 "zero_optimization.stage3_gather_16bit_weights_on_model_save"):
        ours, theirs = built, plugin.deepspeed_config
        for part in path.split("."):
            ours, theirs = ours[part], theirs[part]
        assert ours == theirs, path
