"""Quiet by default (hf_scale.quiet), fast help (hf_scale.commands.cli imports only the command being run), and
train.py's grouped --help (hf_scale.contract.flag_help). In-process, except the one fresh interpreter that proves
what `--help` imports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys

import pytest
from transformers import TrainingArguments

from hf_scale import quiet
from hf_scale.commands.cli import COMMANDS, main
from hf_scale.contract import flag_help as train_help
from hf_scale.contract.data_arguments import DataArguments, SourceArguments
from hf_scale.contract.model_arguments import ModelArguments
from hf_scale.contract.parser import build_parser
from hf_scale.contract.scale_arguments import ScaleArguments

HEAVY = ("torch", "transformers", "accelerate", "deepspeed", "datasets", "matplotlib")


def test_help_of_every_command_imports_none_of_the_heavy_libraries():
    """`hf-scale --help` and `hf-scale COMMAND --help` load no torch/transformers/accelerate/DeepSpeed; the top
    level not even pydantic. A fresh interpreter runs them all and lists what got imported."""
    script = f"""
import json, sys
from hf_scale.commands.cli import main
seen = {{}}
for command in [None, *{list(COMMANDS)!r}]:
    try:
        main(([command] if command else []) + ["--help"])
    except SystemExit:
        pass
    seen[command or "top"] = [m for m in {[*HEAVY, "pydantic"]!r} if m in sys.modules]
print(json.dumps(seen), file=sys.stderr)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stderr.splitlines()[-1])
    assert seen["top"] == []
    assert {command: loaded for command, loaded in seen.items() if set(loaded) - {"pydantic"}} == {}


def test_top_level_help_lists_every_command_with_its_summary(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert f"    {command} " in out
    assert "--verbose" in out and quiet.VERBOSE_ENV in out


@pytest.mark.parametrize("argv", [["--verbose", "presets"], ["presets", "--verbose"]])
def test_verbose_is_taken_before_or_after_the_command(argv, capsys):
    assert main(argv) == 0
    assert "zero3" in capsys.readouterr().out


def _deepspeed_record(message: str, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(quiet.DEEPSPEED_LOGGER, level, "real_accelerator.py", 213, message, None, None)


def _passes(record: logging.LogRecord) -> bool:
    return logging.getLogger(quiet.DEEPSPEED_LOGGER).filter(record)


def test_commands_drop_only_deepspeeds_no_gpu_notice():
    quiet.quiet_command()
    quiet.quiet_command()  # idempotent
    try:
        assert not _passes(_deepspeed_record("Setting accelerator to CPU. If you have GPU or other accelerator, ..."))
        assert _passes(_deepspeed_record("Setting ds_accelerator to cuda (auto detect)"))
        assert _passes(_deepspeed_record("gradient overflow, skipping step", logging.WARNING))
        assert len(logging.getLogger(quiet.DEEPSPEED_LOGGER).filters) == 1
    finally:
        quiet.undo()
    assert _passes(_deepspeed_record("Setting accelerator to CPU."))


def test_replicas_log_errors_only_and_keep_the_users_own_settings(monkeypatch):
    for name in quiet._REPLICA_ENV:
        # Set, then removed: monkeypatch records the variable only so, and restores it after the test; a bare
        # delenv of an absent variable records nothing, and what quiet_training sets would outlive the test.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")  # set by the user: kept
    quiet.quiet_training(replica=True)
    try:
        assert not _passes(_deepspeed_record("Rank 1: some notice", logging.WARNING))
        assert _passes(_deepspeed_record("Rank 1: out of memory", logging.ERROR))
        import os

        assert os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1"
        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"
    finally:
        quiet.undo()
    assert _passes(_deepspeed_record("Rank 1: some notice", logging.WARNING))


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [([], "", False), (["--verbose"], "", True), (["--verbose=true"], "", True), (["--x", "1"], "1", True),
     (["--verbose_not"], "0", False)],
)
def test_verbose_comes_from_the_flag_or_the_environment(argv, env, expected, monkeypatch):
    monkeypatch.setenv(quiet.VERBOSE_ENV, env)
    assert quiet.verbose_requested(argv) is expected


def test_held_records_are_dropped_with_a_refusal_and_replayed_otherwise(caplog):
    """A child logger created while the block runs (datasets' builder modules are imported lazily) is held too:
    its record reaches the parent's handler, whose filter holds it."""
    from hf_scale.errors import UserError

    parent = logging.getLogger("hf_scale_test_library")
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    parent.addHandler(handler)
    try:
        with pytest.raises(UserError), quiet.held("hf_scale_test_library"):
            logging.getLogger("hf_scale_test_library.builder").error("Failed to load JSON")
            raise UserError("one line")
        assert seen == []
        with quiet.held("hf_scale_test_library"):
            logging.getLogger("hf_scale_test_library.builder2").error("a notice")
            assert seen == []
        assert seen == ["a notice"]
        logging.getLogger("hf_scale_test_library.builder").error("after")
        assert seen == ["a notice", "after"]  # the filters are gone
    finally:
        parent.removeHandler(handler)


def test_library_progress_bars_are_drawn_on_a_terminal_only(monkeypatch):
    import datasets
    from transformers.utils import logging as transformers_logging

    monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    before = datasets.is_progress_bar_enabled(), transformers_logging.is_progress_bar_enabled()
    try:
        datasets.enable_progress_bars()
        transformers_logging.enable_progress_bar()
        monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
        quiet.progress_bars_on_a_terminal_only()
        assert datasets.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()
        monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
        monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "0")  # the user's own choice stands
        quiet.progress_bars_on_a_terminal_only()
        assert datasets.is_progress_bar_enabled() and not transformers_logging.is_progress_bar_enabled()
        monkeypatch.delenv("HF_DATASETS_DISABLE_PROGRESS_BARS")
        quiet.progress_bars_on_a_terminal_only()
        assert not datasets.is_progress_bar_enabled()
        # A generated launch script's filter (a pipe) with a terminal behind it: HF_SCALE_TERMINAL=1.
        datasets.enable_progress_bars()
        monkeypatch.setenv("HF_SCALE_TERMINAL", "1")
        quiet.progress_bars_on_a_terminal_only()
        assert datasets.is_progress_bar_enabled()
        # Set after datasets was imported (datasets reads it only then): followed all the same, whatever an earlier
        # caller in this process left the bars at.
        datasets.enable_progress_bars()
        monkeypatch.setenv("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        quiet.progress_bars_on_a_terminal_only()
        assert not datasets.is_progress_bar_enabled()
    finally:
        (datasets.enable_progress_bars if before[0] else datasets.disable_progress_bars)()
        (transformers_logging.enable_progress_bar if before[1] else transformers_logging.disable_progress_bar)()


@pytest.mark.parametrize(("rank", "replica"), [(None, False), ("0", False), ("1", True), ("15", True)])
def test_replica_is_any_rank_but_the_first(rank, replica):
    assert quiet.is_replica({} if rank is None else {"RANK": rank}) is replica


# --- train.py --help --------------------------------------------------------------------------------------


def _flags(cls) -> set[str]:
    return {f"--{f.name}" for f in dataclasses.fields(cls) if f.init}


def _sections(text: str) -> dict[str, set[str]]:
    """Section title -> the flags listed in it (the first word of each `  --flag ...` line)."""
    sections, title = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = set()
        elif title is not None and line.startswith("  -"):
            sections[title].add(line.split()[0].rstrip(","))
    return sections


def test_train_help_leads_with_hf_scales_own_flags_and_the_most_used_training_flags():
    text = build_parser().format_help()
    options = _sections(text)
    assert list(options) == ["model", "data", "hf_scale", f"{train_help.TRAINING}, the most used"]
    assert options["model"] == _flags(ModelArguments)
    assert options["data"] == _flags(DataArguments) | _flags(SourceArguments)
    assert options["hf_scale"] == _flags(ScaleArguments) | {"--config", "-h", "--help-all"}
    assert options[f"{train_help.TRAINING}, the most used"] == {f"--{n}" for n in train_help.COMMON_TRAINING_FLAGS}
    assert "more TrainingArguments flags" in text and "train.py --help-all" in text
    assert "(default: None)" not in text and "--learning-rate" not in text  # one spelling per flag
    assert text.count("\n") < 300  # was 718 lines with every TrainingArguments flag


def test_every_common_training_flag_is_a_training_argument():
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(train_help.COMMON_TRAINING_FLAGS) <= names


def test_help_all_shows_every_flag_the_parser_takes(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_known_args(["--help-all"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    listed = set().union(*_sections(out).values())
    assert _flags(TrainingArguments) <= listed
    every = {a.option_strings[0] for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS}
    assert every <= listed
