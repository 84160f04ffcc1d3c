"""`python train.py --help` without loading transformers or torch: the help is rendered from a snapshot of
train.py's parser, `hf_scale/assets/train_help.json` (every flag's spellings, help, default, choices and section),
by the same formatter (help.GroupedHelp) the live parser uses.

Building the live parser imports transformers for TrainingArguments' ~200 flags (seconds, torch included); the
help is needed before any of that. The snapshot is generated from the live parser and a test renders both at
several widths and requires the same text, so a transformers upgrade or a changed flag fails it until the
snapshot is regenerated:

    python -m hf_scale.contract.help_snapshot
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from hf_scale.contract.flag_help import GroupedHelp

SNAPSHOT = Path(__file__).resolve().parents[1] / "assets" / "train_help.json"
HELP_ALL = "--help-all"
HELP_FLAGS = ("-h", "--help", HELP_ALL)
_RECORDED = ("option_strings", "dest", "nargs", "default", "choices", "help", "metavar")


def help_requested(argv: Sequence[str]) -> bool:
    """Whether argparse would print train.py's help for this command line (it does so for -h, --help and
    --help-all wherever they stand; the parser takes no abbreviation)."""
    return any(arg in HELP_FLAGS for arg in argv)


def _shown(value):
    """A value as the help shows it (argparse formats defaults and choices with %s)."""
    return value if value is None or isinstance(value, (int, float, str, bool)) else str(value)


def record(parser: GroupedHelp) -> dict:
    """What the help of `parser` (train.py's, built by setup.parser.build_parser) is made of."""
    actions = []
    for action in parser._actions:
        if "-h" in action.option_strings:
            continue  # argparse adds it to every parser first
        if HELP_ALL in action.option_strings:  # GroupedHelp adds it, after the dataclasses' flags: keep its place
            actions.append(HELP_ALL)
            continue
        entry = {key: getattr(action, key) for key in _RECORDED}
        entry["default"] = _shown(entry["default"])
        entry["choices"] = None if action.choices is None else [_shown(c) for c in action.choices]
        actions.append(entry)
    sections = parser.section_of_dest()
    return {"prog": parser.prog, "usage": parser.usage, "description": parser.description, "actions": actions,
            "sections": sections}


class SnapshotParser(GroupedHelp, argparse.ArgumentParser):
    """A parser that only prints train.py's help, from the snapshot (it never parses a run's flags)."""

    def __init__(self, snapshot: dict):
        super().__init__(prog=snapshot["prog"], usage=snapshot["usage"], description=snapshot["description"])
        self._sections = snapshot["sections"]
        help_all = self._actions.pop()  # GroupedHelp's, put back where the live parser has it
        for entry in snapshot["actions"]:
            if entry == HELP_ALL:
                self._actions.append(help_all)
                continue
            # argparse compares with SUPPRESS by identity: the string read back from JSON must be that object.
            entry = {k: argparse.SUPPRESS if v == argparse.SUPPRESS else v for k, v in entry.items()}
            self._add_action(argparse.Action(**entry))

    def section_of_dest(self) -> dict[str, str]:
        return dict(self._sections)


def print_help(argv: Sequence[str]) -> None:
    """Print what train.py's parser prints for `argv` (one of HELP_FLAGS is in it) and exit 0."""
    parser = SnapshotParser(json.loads(SNAPSHOT.read_text()))
    first = next(arg for arg in argv if arg in HELP_FLAGS)  # argparse acts on the first one it meets
    print(parser.format_help(full=first == HELP_ALL), end="")
    sys.exit(0)


def write_snapshot() -> Path:
    from hf_scale.contract.parser import build_parser

    SNAPSHOT.write_text(json.dumps(record(build_parser()), indent=1, sort_keys=True) + "\n")
    return SNAPSHOT


if __name__ == "__main__":
    print(f"wrote {write_snapshot()}")
