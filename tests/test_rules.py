"""hf_scale.rules: each rule of a run in one place, proven against the libraries and train.py's parser.
In-process and fast."""

from __future__ import annotations

import pytest

from hf_scale import rules


@pytest.fixture(scope="module")
def train_py_parser():
    from hf_scale.train.main import build_parser

    return build_parser()


def test_flag_given_knows_every_spelling_of_train_py_parser_and_nothing_else(train_py_parser):
    """Every option string of train.py's parser counts as its field given; an abbreviation or a prefix never does
    (train.py's parser has allow_abbrev=False)."""
    assert train_py_parser.allow_abbrev is False
    for option, action in train_py_parser._option_string_actions.items():
        if not option.startswith("--") or action.dest == "help":
            continue
        assert rules.flag_given([option], action.dest), (option, action.dest)
        assert rules.flag_given([f"{option}=1"], action.dest), option
        assert not rules.flag_given([option[:-1]], action.dest), option


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
def test_flag_given(argv, name, given):
    assert rules.flag_given(argv, name) is given
