"""The rules of a run, each computed in ONE place and imported wherever it is needed (config, generators,
`hf-scale check`, train.py's reconcile and guard).

Pure functions and constant tables only: no I/O, and nothing heavier than the standard library is imported,
so that every layer (the CLI's --help included) can use them.
"""

from __future__ import annotations

from collections.abc import Sequence


def flag_given(argv: Sequence[str], name: str) -> bool:
    """Whether the flag of the field ``name`` was typed in ``argv`` (``--name`` or ``--name=value``), in any
    spelling train.py's HfArgumentParser accepts for it: ``--name``, the dashed ``--na-me``, and for booleans
    that default to true ``--no_name`` / ``--no-na-me``. train.py's parser takes no abbreviation
    (``allow_abbrev=False``), so neither does this: an abbreviation is refused there, never "given".
    tests/test_rules.py proves the spellings against every option of train.py's parser."""
    dashed = name.replace("_", "-")
    spellings = {f"--{name}", f"--{dashed}", f"--no_{name}", f"--no-{dashed}"}
    return any(arg.split("=", 1)[0] in spellings for arg in argv)
