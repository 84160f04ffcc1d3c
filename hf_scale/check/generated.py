"""Fixes for files `hf-scale generate` wrote: such a file says "do not edit" in its header (the next `generate` would
undo an edit), so a fix that starts "In NAME, change X" is turned into one that says where the change belongs: the
hf_scale config (or the preset and its `--set`s) it was generated from, then the command in its header regenerates it.
The header is the one `hf_scale.commands.generate` writes at the top of every YAML and script; a JSON file has none, and
its fixes are left as they are."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from hf_scale.check.findings import TRAINING_ARGS, Finding, in_file
from hf_scale.generators.output_paths import GENERATED_HEADER

_HEADER = re.compile(r"\A(?:#[^\n]*\n)*?"  # comment lines before it (a script's #!)
                     rf"# {re.escape(GENERATED_HEADER)}\n#\s+(?P<command>[^\n]+)")
_HEADER_BYTES = 4096
"""The header is the file's first lines: enough of the file to hold it."""


def regenerate_command(path: str) -> str | None:
    """The command in the header of a file `hf-scale generate` wrote, or None for any other file (or one that cannot
    be read again: check has read it already, a failure here only keeps the plain fix)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            head = handle.read(_HEADER_BYTES)
    except OSError:
        return None
    match = _HEADER.match(head)
    return match["command"].strip() if match else None


def regenerated_fixes(findings: list[Finding]) -> list[Finding]:
    """``findings`` with the fixes that edit a generated file redirected to its source and the regeneration."""
    commands: dict[str, str | None] = {}
    out = []
    for finding in findings:
        start = in_file(finding.file)
        if finding.file != TRAINING_ARGS and finding.fix.startswith(start):
            if finding.file not in commands:
                commands[finding.file] = regenerate_command(finding.file)
            command = commands[finding.file]
            if command is not None:
                rest = finding.fix[len(start):]
                finding = replace(finding, fix=(
                    f"{Path(finding.file).name} is generated (do not edit it): make the change in the hf_scale config "
                    "it was generated from (or with --set on that command), then regenerate it with "
                    f"`{command}`. The change: {rest[:1].upper()}{rest[1:]}"))
        out.append(finding)
    return out
