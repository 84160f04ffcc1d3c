"""train.py's flags read exactly as train.py reads them, for every command that hands flags to a train.py that runs
later or elsewhere: `hf-scale check -- ARGS`, the command of a manifest (`check --manifest`), `hf-scale generate`'s
``cluster.train_args`` and the Ray driver (`python -m hf_scale.commands.ray_train`). A flag train.py would refuse is
found before a job queues, not on the cluster.

The reading is train.py's own: its parser (hf_scale.contract.parser.build_parser: every TrainingArguments flag
plus train.py's model/data/hf_scale flags, no abbreviations, an unknown flag refused, the last of a repeated flag
wins), a recipe file expanded before the flags, the value ranges train.py checks first (flag_values), and a
DistributedConfig's fills and contradictions by the function train.py applies
(hf_scale.contract.config_flags.fill_flags_from_config).
TrainingArguments itself is not built (its __post_init__ touches devices).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainFlags:
    """train.py's flags, parsed."""

    namespace: argparse.Namespace
    given: frozenset[str]
    """The flags given, as train.py decides it once: a recipe's and the command line's (and, after
    :func:`against_config`, the flags the config fixed: they count as typed, as in train.py)."""
    contradictions: tuple[str, ...] = field(default=())
    """Where the flags contradict the DistributedConfig (:func:`against_config`): train.py's own one-line messages."""

    @property
    def values(self) -> dict[str, Any]:
        return vars(self.namespace)


def parse_train_flags(argv: Sequence[str], *, read_recipe: bool = True) -> TrainFlags:
    """``argv`` as train.py parses it; :class:`UserError` with train.py's own message where it would refuse them
    (an unknown flag, an abbreviation, a value of the wrong type or out of range). ``read_recipe=False``: a recipe
    file the arguments name is left unread (it lives where the job runs, e.g. in the image); its flags are then
    train.py's to check at start."""
    from hf_scale.contract import flag_values
    from hf_scale.contract.parser import parse_flags

    with _environment_kept():  # a recipe's `env:` is for the training processes, not for this process
        namespace, given, _ = parse_flags(list(argv), read_recipe=read_recipe)
    flag_values.check(namespace)  # each value in its range, as train.py checks it first
    return TrainFlags(namespace, given)


def against_config(flags: TrainFlags, config: Any, where: str) -> TrainFlags:
    """``flags`` with the values a DistributedConfig fills (as ``--hf_scale_config`` fills them in train.py) and
    its contradictions with the flags given; ``where`` leads each contradiction (train.py writes
    ``--hf_scale_config=FILE``)."""
    from hf_scale.contract.config_flags import (
        checkpointing_flag,
        fill_flags_from_config,
        filled,
    )
    from hf_scale.contract.shared_values import FIXED_BY_HF_SCALE_CONFIG

    from_config = fill_flags_from_config(config, flags.namespace, flags.given, where)
    namespace = filled(flags.namespace, from_config.fills)
    fixed = {*FIXED_BY_HF_SCALE_CONFIG, checkpointing_flag(namespace)}
    return TrainFlags(namespace, flags.given | fixed, from_config.contradictions)


def last_value(argv: Sequence[str], names: tuple[str, ...]) -> str | None:
    """The value of the last of ``names`` in ``argv`` (``--flag VALUE`` or ``--flag=VALUE``): argparse's rule for a
    flag given twice, for arguments that could not be parsed whole."""
    found = None
    for index, arg in enumerate(argv):
        flag, equals, value = arg.partition("=")
        if flag in names:
            found = value if equals else (argv[index + 1] if index + 1 < len(argv) else None)
    return found


@contextlib.contextmanager
def _environment_kept() -> Iterator[None]:
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
