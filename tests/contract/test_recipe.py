"""The recipe file: `python train.py recipe.yaml` / `--config recipe.yaml`, command-line flags overriding it,
the launchers' extra arguments, one-line errors, recipe values counting as given flags for
--hf_scale_config, and the starter recipe of `hf-scale generate --recipe`.

(The launchers running a recipe for real: tests/train/loops/test_loops_equivalence.py, where the `deepspeed` launcher's
run takes its flags from a positional recipe and an `accelerate launch` run from `--config`.)
"""

from __future__ import annotations

import json

import pytest
import yaml

from hf_scale.commands.cli import main as cli_main
from hf_scale.config.presets import load_preset
from hf_scale.contract.config_flags import checkpointing_flag
from hf_scale.contract.parser import build_parser
from hf_scale.contract.recipe import expand_recipe
from hf_scale.errors import UserError
from hf_scale.train.main import main as train_main


def _write(path, data) -> str:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return str(path)


def _parse(argv: list[str]):
    """train.py's own parsing: the recipe expanded, one spelling of activation checkpointing."""
    from hf_scale.train.prepare import _parse as parse_train_flags

    return parse_train_flags(argv)


RECIPE = {
    "learning_rate": "2e-5",  # YAML 1.1 reads 2e-5 as a string: the flag's own type converts it
    "per_device_train_batch_size": 2,
    "gradient_checkpointing": True,
    "loop": "accelerate",
    "train_file": ["a.jsonl", "b.jsonl"],
    "mixture_weights": [0.7, 0.3],
    "lr_scheduler_kwargs": {"num_cycles": 2},
    "max_steps": None,  # null keeps the default
    "output_dir": "runs/x",
}


@pytest.mark.parametrize(
    "shape",
    ["positional-first", "positional-after-local-rank", "positional-after-deepspeed-flag", "config-flag"],
)
def test_the_recipe_is_read_however_the_launcher_passes_it(shape, tmp_path):
    recipe = _write(tmp_path / "r.yaml", RECIPE)
    argv = {
        "positional-first": [recipe],
        "positional-after-local-rank": ["--local_rank=1", recipe],  # what the deepspeed launcher appends
        "positional-after-deepspeed-flag": ["--deepspeed", str(tmp_path / "ds.json"), recipe],  # launch scripts
        "config-flag": ["--config", recipe],
    }[shape]
    ns, _, path = _parse(argv)
    assert path == recipe
    assert ns.learning_rate == 2e-5 and ns.per_device_train_batch_size == 2
    assert getattr(ns, checkpointing_flag(ns)) is True
    assert ns.loop == "accelerate" and ns.train_file == ["a.jsonl", "b.jsonl"] and ns.mixture_weights == [0.7, 0.3]
    assert ns.lr_scheduler_kwargs == {"num_cycles": 2} and ns.max_steps == -1  # a JSON object, parsed
    assert ns.output_dir == "runs/x"
    if shape == "positional-after-local-rank":
        assert ns.local_rank == 1


def test_command_line_flags_override_the_recipe(tmp_path):
    recipe = _write(tmp_path / "r.json", json.dumps(RECIPE))  # JSON recipes too
    argv = ["--learning_rate", "1e-3", recipe, "--train_file", "c.jsonl", "--gradient_checkpointing", "false"]
    ns, _, _ = _parse(argv)
    assert ns.learning_rate == 1e-3 and ns.train_file == ["c.jsonl"] and getattr(ns, checkpointing_flag(ns)) is False
    assert ns.per_device_train_batch_size == 2  # not overridden: the recipe's


def test_without_a_recipe_the_arguments_are_untouched():
    argv = ["--max_steps", "3", "--deepspeed", "ds.json"]
    assert expand_recipe(build_parser(), argv) == (argv, None)


def test_env_block_sets_environment_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_SCALE_TEST_RECIPE_VAR", "before")  # restored after the test
    recipe = _write(tmp_path / "r.yaml", {"env": {"HF_SCALE_TEST_RECIPE_VAR": 7}, "max_steps": 2})
    ns, _, _ = _parse([recipe])
    import os

    assert os.environ["HF_SCALE_TEST_RECIPE_VAR"] == "7" and ns.max_steps == 2


BAD_RECIPES = {
    "unknown-key": ("learnign_rate: 1e-4\n", "recipe {r}: unknown key 'learnign_rate'; did you mean 'learning_rate'?"),
    "wrong-int": ("per_device_train_batch_size: 2.5\n",
                  "recipe {r}: per_device_train_batch_size: '2.5' is not an integer"),
    "wrong-bool": ("bf16: maybe\n", "recipe {r}: bf16: 'maybe' is not true or false"),
    "wrong-choice": ("loop: keras\n", "recipe {r}: loop: 'keras' is not one of trainer, accelerate"),
    "list-for-one-value": ("learning_rate: [1, 2]\n", "recipe {r}: learning_rate: takes one value, got a list"),
    "mapping-for-a-path": ("deepspeed: {zero_optimization: {stage: 3}}\n",
                           "recipe {r}: deepspeed: takes a single value, got a mapping"),
    "not-a-mapping": ("- max_steps\n", "recipe {r}: expected a mapping of flag names to values, got a list"),
    "duplicate-key": (
        "max_steps: 1\nmax_steps: 2\n",
        "recipe {r}: not valid YAML at line 2, column 1: duplicate key 'max_steps' (first at line 1)",
    ),
    "invalid-yaml": ("max_steps: [1\n", "recipe {r}: not valid YAML"),
    "nested-recipe": ("config: other.yaml\n", "recipe {r}: config: a recipe cannot name another recipe"),
    "bad-env": ("env: [A]\n", "recipe {r}: env must be a mapping of variable names to values"),
}


def _one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("train.py: error: ")
    return lines[0].removeprefix("train.py: error: ")


@pytest.mark.parametrize(("text", "message"), BAD_RECIPES.values(), ids=BAD_RECIPES.keys())
def test_bad_recipe_is_one_line_exit_2_and_nothing_written(text, message, tmp_path, capsys):
    recipe = _write(tmp_path / "r.yaml", text)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        train_main([recipe, "--output_dir", str(out)])
    assert exit_info.value.code == 2
    assert _one_error_line(capsys).startswith(message.format(r=recipe))
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{tmp}/missing.yaml"], "recipe {tmp}/missing.yaml: not found"),
        (["{tmp}/a.yaml", "{tmp}/b.yaml"], "several recipe files given ({tmp}/a.yaml, {tmp}/b.yaml); pass one"),
        (["{tmp}/a.yaml", "--config", "{tmp}/b.yaml"], "a recipe given twice: {tmp}/a.yaml and --config {tmp}/b.yaml"),
    ],
    ids=["missing", "two-positional", "positional-and-config"],
)
def test_recipe_file_errors(argv, message, tmp_path, capsys):
    for name in ("a.yaml", "b.yaml"):
        _write(tmp_path / name, {"max_steps": 1})
    with pytest.raises(SystemExit) as exit_info:
        train_main([a.format(tmp=tmp_path) for a in argv] + ["--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert _one_error_line(capsys).startswith(message.format(tmp=tmp_path))
    assert not (tmp_path / "out").exists()


def test_a_recipe_value_conflicting_with_hf_scale_config_is_reported_like_a_flag(tmp_path, capsys):
    config = _write(tmp_path / "single.yaml",
                    {"strategy": "single", "precision": "no", "batch": {"micro_batch_size": 4}})
    recipe = _write(tmp_path / "r.yaml", {"hf_scale_config": config, "per_device_train_batch_size": 3})
    with pytest.raises(SystemExit) as exit_info:
        train_main([recipe, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert _one_error_line(capsys) == (
        f"--hf_scale_config={config}: batch.micro_batch_size=4 but --per_device_train_batch_size=3"
    )


def test_help_names_the_recipe(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "--config RECIPE.yaml" in text and "python train.py recipe.yaml" in " ".join(text.split())


# --- the starter recipe of `hf-scale generate --recipe` -------------------------------------------------------
SETS = ["batch.micro_batch_size=2", "batch.gradient_accumulation_steps=4", "activation_checkpointing=true",
        "optimizer.lr=3e-4", "optimizer.betas=[0.9,0.95]", "optimizer.weight_decay=0.1", "gradient_clipping=0.5",
        "precision=fp16"]


def _generate(out, *extra) -> int:
    argv = ["generate", "--preset", "zero2", "--name", "run", "--output-dir", str(out), "--recipe", *extra]
    for item in SETS:
        argv += ["--set", item]
    return cli_main(argv)


def test_generated_recipe_is_read_by_train_py_with_the_configs_values(tmp_path):
    assert _generate(tmp_path) == 0
    cfg = load_preset("zero2", overrides=SETS)
    recipe = tmp_path / "recipes" / "run.yaml"
    ns, _, _ = _parse([str(recipe)])
    assert ns.per_device_train_batch_size == cfg.batch.micro_batch_size == 2
    assert ns.gradient_accumulation_steps == cfg.batch.gradient_accumulation_steps == 4
    assert (ns.fp16, ns.bf16) == (True, False)
    assert getattr(ns, checkpointing_flag(ns)) is True
    assert ns.max_grad_norm == 0.5
    assert (ns.learning_rate, ns.adam_beta1, ns.adam_beta2, ns.adam_epsilon, ns.weight_decay) == (
        3e-4, 0.9, 0.95, cfg.optimizer.eps, 0.1)
    assert ns.eval_strategy == "no" and ns.loop == "trainer" and ns.output_dir == "outputs/run"
    # Every documented key is a train.py flag (null keys too: they would be unknown keys otherwise).
    keys = yaml.safe_load(recipe.read_text())
    assert {"model_name_or_path", "train_file", "mixture_weights", "chat_template_path", "push_to_hub"} <= set(keys)
    # The launch scripts' regenerate line keeps --recipe, and regenerating leaves the files as they are.
    assert "--recipe" in (tmp_path / "launch" / "run.torchrun.sh").read_text()
    assert _generate(tmp_path) == 0


def test_an_edited_recipe_is_not_overwritten_without_force(tmp_path, capsys):
    assert _generate(tmp_path) == 0
    recipe = tmp_path / "recipes" / "run.yaml"
    recipe.write_text(recipe.read_text() + "max_steps: 100\n")
    with pytest.raises(SystemExit) as exit_info:
        _generate(tmp_path)
    assert exit_info.value.code == 2 and "exists with different content" in capsys.readouterr().err
    assert recipe.read_text().endswith("max_steps: 100\n")


def test_recipe_reader_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        expand_recipe(build_parser(), [str(tmp_path / "none.yml")])
