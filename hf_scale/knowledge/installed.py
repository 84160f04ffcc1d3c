"""What is installed on this node: a distribution's version from its package metadata, without importing it
(importing torch-side packages costs seconds, and a broken install would raise instead of answering)."""

from __future__ import annotations

import importlib.metadata
import platform

PYTHON = "python"
"""Not a distribution: the interpreter running, asked for as one where a table of version floors names it."""


def version_of(distribution: str) -> str | None:
    """The installed version of ``distribution`` (its pip name, e.g. ``liger-kernel``; ``python``: the interpreter),
    or None when not installed."""
    if distribution == PYTHON:
        return platform.python_version()
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
