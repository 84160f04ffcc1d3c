"""train.py's prepare stage decides which flags were given once, from the command line and the recipe, and hands
that set down: nothing after it reads the raw argv again. In-process and fast."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

import hf_scale
from hf_scale.train.prepare import _parse

PACKAGE = Path(hf_scale.__file__).parent

READS_THE_FLAGS = {("hf_scale/contract/parser.py", "parse_flags")}
"""Where a command line's flags become the set of given flags, for train.py's prepare stage and for the flags
handed to a train.py elsewhere (`hf-scale check`'s training args, a manifest's command, cluster.train_args, the Ray
driver: hf_scale.check.train_flags.parse_train_flags), which are read exactly as train.py reads them."""

PASS_THE_COMMAND_LINE = {
    ("hf_scale/train/main.py", "main"), ("hf_scale/train/main.py", "train"),
    ("hf_scale/train/prepare.py", "prepare"), ("hf_scale/train/prepare.py", "_parse"),
    ("hf_scale/contract/parser.py", "parse_flags"),  # the reading itself, for _parse
    ("hf_scale/contract/recipe.py", "expand_recipe"),  # the recipe's values become flags before _parse reads them
    ("hf_scale/contract/recipe.py", "recipe_argument"),  # where the recipe is among them (expand_recipe's 1st step)
    ("hf_scale/knowledge/rules.py", "given_flags"),  # which flags were given
    # --help, answered from the parser's snapshot before anything loads (it exits: no run is prepared).
    ("hf_scale/contract/help_snapshot.py", "help_requested"),
    ("hf_scale/contract/help_snapshot.py", "print_help"),
}
"""The functions of train.py's path that take the command line (an `argv`): it goes down to _parse only."""


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def test_the_given_flags_are_computed_in_one_place_per_command_line():
    callers = set()
    for path in PACKAGE.rglob("*.py"):
        for function in _functions(path):
            calls = [n for n in ast.walk(function) if isinstance(n, ast.Call) and _called_name(n) == "given_flags"]
            if calls:
                callers.add((str(path.relative_to(PACKAGE.parent)), function.name))
    assert callers == READS_THE_FLAGS


def test_after_the_prepare_stage_reads_it_no_function_of_train_py_takes_the_raw_argv():
    modules = [*(PACKAGE / "train").rglob("*.py"), *(PACKAGE / "contract").rglob("*.py"),
               PACKAGE / "knowledge" / "deepspeed_overrides.py", PACKAGE / "knowledge" / "rules.py"]
    taking_argv = set()
    for path in modules:
        for function in _functions(path):
            arguments = function.args
            names = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]}
            if "argv" in names:
                taking_argv.add((str(path.relative_to(PACKAGE.parent)), function.name))
    assert taking_argv == PASS_THE_COMMAND_LINE


def test_given_covers_the_recipe_and_the_command_line_in_every_spelling(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"learning_rate": 1e-4, "output_dir": str(tmp_path / "out")}))
    ns, given, recipe_path = _parse([str(recipe), "--per-device-train-batch-size=2", "--no_dataloader_pin_memory",
                                     "--run_name", "bf16"])
    assert recipe_path == str(recipe)
    assert given == {"learning_rate", "output_dir", "per_device_train_batch_size", "dataloader_pin_memory",
                     "run_name"}
    assert (ns.learning_rate, ns.per_device_train_batch_size, ns.dataloader_pin_memory) == (1e-4, 2, False)


def test_nothing_given_is_the_empty_set():
    _, given, recipe_path = _parse([])
    assert given == frozenset() and recipe_path is None
