"""A recipe file for the whole run: `python train.py recipe.yaml` or `python train.py --config recipe.yaml`.

The recipe is a flat YAML (or JSON) mapping of train.py flag names to values — model, data, training
arguments and hf_scale's own (`loop`, `hf_scale_config`, ...) alike, the convention of TRL's
`--config` and alignment-handbook's recipes — plus an optional `env:` mapping of environment
variables (TRL's convention). Flags on the command line override it.

How: every recipe value is checked on its own (unknown key → the closest name; wrong type → what the
flag takes), turned into `--key=value` tokens and put *before* the command-line flags, so argparse
applies both with one rule (the last occurrence wins) and the recipe's values count as flags "given"
for `--hf_scale_config`'s conflict check (hf_scale.train.setup.reconcile).

The recipe may sit anywhere among the arguments as the one positional argument (the `deepspeed`
launcher adds `--local_rank=N` before it, generated launch scripts add `--deepspeed FILE`); put it
before flags that take several values (`--train_file a b`), which would otherwise swallow it.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
from pathlib import Path
from typing import Any

from hf_scale.errors import UserError

RECIPE_SUFFIXES = (".yaml", ".yml", ".json")
ENV_KEY = "env"
"""Environment variables to set before anything else runs (TRL's recipe convention)."""
CONFIG_FLAG = "--config"


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        CONFIG_FLAG,
        metavar="RECIPE.yaml",
        default=None,
        help="A recipe: a YAML/JSON mapping of these flags' names to values (plus an optional env: mapping). "
        "Flags on the command line override it. Same as giving the file as the one positional argument: "
        "python train.py recipe.yaml.",
    )


def expand_recipe(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], str | None]:
    """`argv` with the recipe's values put before the command-line flags; and the recipe's path.

    Without a recipe, `argv` comes back unchanged. Sets the recipe's `env:` variables.
    """
    rest, path = recipe_argument(parser, argv)
    if path is None:
        return argv, None
    recipe = read_recipe(path)
    _set_env(path, recipe.pop(ENV_KEY, None))
    return recipe_tokens(parser, recipe, path) + rest, path


def recipe_argument(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], str | None]:
    """`argv` without the positional recipe file (``--config FILE`` stays: the parser knows it), and the recipe's
    path; (`argv`, None) without one. Nothing is read."""
    namespace, unknown = parser.parse_known_args(argv)
    positional = [a for a in unknown if not a.startswith("-") and a.lower().endswith(RECIPE_SUFFIXES)]
    flagged = getattr(namespace, "config", None)
    if len(positional) > 1:
        raise UserError(f"several recipe files given ({', '.join(positional)}); pass one")
    if positional and flagged:
        raise UserError(f"a recipe given twice: {positional[0]} and {CONFIG_FLAG} {flagged}; pass one")
    path = positional[0] if positional else flagged
    rest = list(argv)
    if positional:
        del rest[len(rest) - 1 - rest[::-1].index(path)]
    return rest, path


def read_recipe(path: str) -> dict[str, Any]:
    """The recipe's mapping; one-line errors for a missing, unreadable or malformed file (hf_scale.files.reading reads
    it strictly: duplicate keys, alias bombs, NaN in JSON, FIFOs and directories are refused)."""
    from hf_scale.files.reading import load_json, load_yaml, read_text

    where = f"recipe {path}"
    text = read_text(path, "recipe", expected="a YAML or JSON mapping of train.py flags")
    data = load_json(text, where) if Path(path).suffix.lower() == ".json" else load_yaml(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: expected a mapping of flag names to values, got a {type(data).__name__}")
    return data


def _set_env(path: str, env: Any) -> None:
    if env is None:
        return
    if not isinstance(env, dict) or not all(isinstance(k, str) and k for k in env):
        raise UserError(f"recipe {path}: {ENV_KEY} must be a mapping of variable names to values")
    for name, value in env.items():
        if isinstance(value, (dict, list)) or value is None:
            raise UserError(f"recipe {path}: {ENV_KEY}.{name}: give a string or a number")
        os.environ[name] = str(value).lower() if isinstance(value, bool) else str(value)


def _recipe_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Recipe key -> the flag's action: every `--name` whose destination is `name` (not the `--no_name`
    complements, nor --help/--config)."""
    actions = {}
    for action in parser._actions:
        if f"--{action.dest}" in action.option_strings and action.nargs != 0 and action.dest != "config":
            actions[action.dest] = action
    return actions


def recipe_tokens(parser: argparse.ArgumentParser, recipe: dict[str, Any], path: str) -> list[str]:
    """Command-line tokens saying what the recipe says; every key and value checked first."""
    actions = _recipe_actions(parser)
    tokens: list[str] = []
    for key, value in recipe.items():
        if not isinstance(key, str) or key not in actions:
            if key == "config":
                raise UserError(f"recipe {path}: config: a recipe cannot name another recipe")
            close = difflib.get_close_matches(str(key), list(actions), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else "; see python train.py --help for the flags"
            raise UserError(f"recipe {path}: unknown key '{key}'{hint}")
        if value is None:  # `key: null` (or `key:`) keeps the default, as in the generated starter recipe
            continue
        tokens += _tokens(actions[key], key, value, path)
    return tokens


def _tokens(action: argparse.Action, key: str, value: Any, path: str) -> list[str]:
    where = f"recipe {path}: {key}"
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        if not items:
            raise UserError(f"{where}: an empty list; give at least one value or remove the key")
        texts = [_text(where, item, dict_allowed=False) for item in items]
        for text in texts:
            _check(action, where, text)
        return [f"--{key}", *texts]
    if isinstance(value, list):
        raise UserError(f"{where}: takes one value, got a list")
    text = _text(where, value, dict_allowed=key in _dict_fields())
    _check(action, where, text)
    return [f"--{key}={text}"]


def _dict_fields() -> set[str]:
    from transformers import TrainingArguments

    # --deepspeed is a file here: train.py reads the launcher's JSON from that path.
    return set(getattr(TrainingArguments, "_VALID_DICT_FIELDS", ())) - {"deepspeed"}


def _text(where: str, value: Any, *, dict_allowed: bool) -> str:
    if isinstance(value, dict):
        if not dict_allowed:
            raise UserError(f"{where}: takes a single value, got a mapping")
        return json.dumps(value)  # TrainingArguments parses JSON strings of its dict fields
    if isinstance(value, list):
        raise UserError(f"{where}: a nested list is not a value")
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _check(action: argparse.Action, where: str, text: str) -> None:
    """The same conversion argparse will apply, so a wrong type is reported against the recipe key."""
    try:
        converted = action.type(text) if action.type is not None else text
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise UserError(f"{where}: {text!r} is not {_expected(action)}") from None
    if action.choices is not None and converted not in action.choices:
        raise UserError(f"{where}: {text!r} is not {_expected(action)}")


def _expected(action: argparse.Action) -> str:
    if action.choices is not None:
        return "one of " + ", ".join(str(getattr(c, "value", c)) for c in action.choices)
    names = {int: "an integer", float: "a number", str: "a string"}
    if action.type in names:
        return names[action.type]
    if getattr(action.type, "__name__", "") == "string_to_bool":
        return "true or false"
    return f"a valid --{action.dest} value"
