"""User-facing errors.

Bad input (a config value, a CLI flag, a dataset, a model path) is reported as *one line* that
names the field, the value and what is allowed, and the process exits with code 2 — never a
traceback. Everything that raises :class:`UserError` relies on the entry points
(:func:`hf_scale.commands.cli.main`, ``train.py``) to turn it into that line.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from hf_scale.exit_codes import EXIT_BAD_INPUT, REFUSED_MARKER_ENV, STARTED_MARKER_ENV


class UserError(Exception):
    """Invalid input from the user; the message is a single line shown as is."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def exit_with_user_error(prog: str, error: UserError) -> NoReturn:
    print(f"{prog}: error: {error}", file=sys.stderr)
    sys.exit(error.exit_code)


def exit_refusing(prog: str, error: UserError) -> NoReturn:
    """A training process's exit on ``error``: under a generated launch script (REFUSED_MARKER_ENV set, see
    hf_scale.exit_codes) a refusal (exit 2) is written to the script's marker file by the first rank that refuses,
    and printed by the script once; the other ranks print nothing. Anything else: :func:`exit_with_user_error`."""
    marker = os.environ.get(REFUSED_MARKER_ENV)
    if not marker or error.exit_code != EXIT_BAD_INPUT:
        exit_with_user_error(prog, error)
    try:
        with open(marker, "x", encoding="utf-8") as file:  # "x": one rank's line, never two
            file.write(f"{prog}: error: {error}\n")
    except FileExistsError:
        pass  # another rank wrote it first
    except OSError:  # the script's folder is gone: say it here
        exit_with_user_error(prog, error)
    sys.exit(error.exit_code)


def announce_started() -> None:
    """Tell a generated launch script (STARTED_MARKER_ENV, see hf_scale.exit_codes) that this process's start checks
    passed: it stops holding the launcher's output back. Nothing without the variable; a lost marker only delays it."""
    marker = os.environ.get(STARTED_MARKER_ENV)
    if marker:
        with contextlib.suppress(OSError):  # the folder is gone: the script holds back HOLD_START_S at most
            open(marker, "a", encoding="utf-8").close()


def run_or_exit(prog: str, fn: Callable[[], int | None]) -> int:
    """Run ``fn``; a :class:`UserError` becomes one line on stderr and its exit code (2 unless it says)."""
    try:
        return fn() or 0
    except UserError as error:
        exit_with_user_error(prog, error)
