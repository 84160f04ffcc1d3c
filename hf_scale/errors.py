"""User-facing errors.

Bad input (a config value, a CLI flag, a dataset, a model path) is reported as *one line* that
names the field, the value and what is allowed, and the process exits with code 2 — never a
traceback. Everything that raises :class:`UserError` relies on the entry points
(:func:`hf_scale.cli.main`, ``train.py``) to turn it into that line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from hf_scale.exit_codes import EXIT_BAD_INPUT


class UserError(Exception):
    """Invalid input from the user; the message is a single line shown as is."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def exit_with_user_error(prog: str, error: UserError) -> NoReturn:
    print(f"{prog}: error: {error}", file=sys.stderr)
    sys.exit(error.exit_code)


def run_or_exit(prog: str, fn: Callable[[], int | None]) -> int:
    """Run ``fn``; a :class:`UserError` becomes one line on stderr and its exit code (2 unless it says)."""
    try:
        return fn() or 0
    except UserError as error:
        exit_with_user_error(prog, error)
