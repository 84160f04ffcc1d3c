"""`python train.py --help` from the parser's snapshot: the same text as the live parser's help (so the snapshot
cannot drift from transformers' TrainingArguments or hf_scale's own flags), without importing torch or
transformers. How fast: benchmarks/train_help.py (a ratio to the interpreter's start, not asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from paths import REPO

from hf_scale.contract import help_snapshot
from hf_scale.contract.parser import build_parser

STALE = "the help snapshot is stale: regenerate it with `python -m hf_scale.contract.help_snapshot`"


@pytest.fixture(scope="module")
def live_parser():
    return build_parser()


@pytest.mark.parametrize("columns", ["60", "100", "240"])
@pytest.mark.parametrize("full", [False, True], ids=["help", "help-all"])
def test_the_snapshot_renders_exactly_the_live_parsers_help(live_parser, columns, full, monkeypatch):
    monkeypatch.setenv("COLUMNS", columns)  # argparse wraps at the terminal's width: both must wrap alike
    snapshot = help_snapshot.SnapshotParser(json.loads(help_snapshot.SNAPSHOT.read_text()))
    assert snapshot.format_help(full=full) == live_parser.format_help(full=full), STALE


def test_the_snapshot_records_every_flag_of_the_live_parser(live_parser):
    recorded = json.loads(help_snapshot.SNAPSHOT.read_text())
    assert recorded == json.loads(json.dumps(help_snapshot.record(live_parser))), STALE
    flags = {s for entry in recorded["actions"] if isinstance(entry, dict) for s in entry["option_strings"]}
    assert {"--learning_rate", "--deepspeed", "--loop", "--hf_scale_config", "--train_file", "--config"} <= flags


@pytest.mark.parametrize(
    ("argv", "asked"),
    [(["--help"], True), (["-h"], True), (["recipe.yaml", "--help-all"], True), (["--max_steps", "2"], False),
     (["--he"], False), (["--run_name", "help"], False)],
)
def test_help_requested(argv, asked):
    assert help_snapshot.help_requested(argv) is asked


PROBE = """
import json, sys
sys.argv = ["train.py", *sys.argv[1:]]
from hf_scale.commands import train as entry
try:
    entry.main()
except SystemExit as stop:
    code = stop.code
print(json.dumps({"code": code, "loaded": sorted(m for m in ("torch", "transformers", "datasets", "accelerate",
                                                              "deepspeed") if m in sys.modules)}))
"""


@pytest.mark.parametrize("flag", ["--help", "--help-all"])
def test_the_help_path_loads_neither_torch_nor_transformers(flag):
    result = subprocess.run([sys.executable, "-c", PROBE, flag], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"code": 0, "loaded": []}
    assert "--learning_rate" in result.stdout and "--loop" in result.stdout


def test_train_py_help_prints_the_live_parsers_help(live_parser, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    result = subprocess.run([sys.executable, str(REPO / "train.py"), "--max_steps", "2", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == live_parser.format_help()
